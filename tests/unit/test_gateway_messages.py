"""The Anthropic Messages dialect (agentloop.gateway.dialects.messages): request mapping, refusals
in Anthropic's error shape, the rendered message and its event stream, checked with the anthropic
SDK's own client and models (an httpx mock transport stands in for the gateway; no engine)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anthropic
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from anthropic.types.shared.error_response import ErrorResponse
from pydantic import TypeAdapter

from agentloop.gateway.dialects.messages import (
    DIALECT,
    MAX_MESSAGES,
    count_tokens_body,
    parse,
    parse_count_tokens,
)
from agentloop.gateway.dialects.messages_stream import error_body, thinking_signature
from agentloop.gateway.protocol import GatewayHTTPError
from agentloop.gateway.store import canonical_message
from agentloop.gateway.turn import ReasoningDelta, TextDelta, TurnEvent, TurnRequest, TurnResult

try:  # the anthropic SDK's own HTTP library (httpx2 since anthropic 2.x; httpx before)
    import httpx2 as httpx
except ImportError:
    import httpx

CALC = {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression.",
    "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}},
}
EVENTS = TypeAdapter(RawMessageStreamEvent)


def body(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A Messages request body (a single user question when no messages are given)."""
    msgs = list(messages) or [{"role": "user", "content": "What is 2+3?"}]
    return {"model": "policy", "max_tokens": 64, "messages": msgs, **extra}


def call(call_id: str, expression: str) -> dict[str, Any]:
    """A canonical tool call as the decoder returns it (arguments: the JSON the model wrote)."""
    args = json.dumps({"expression": expression})
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "calculator", "arguments": args},
    }


def result(content: str | None = "", finish: str = "stop", **kw: Any) -> TurnResult:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    for key in ("tool_calls", "reasoning_content"):
        if key in kw:
            message[key] = kw.pop(key)
    return TurnResult(
        message=message,
        finish_reason=finish,
        prompt_tokens=kw.pop("prompt", 21),
        completion_tokens=kw.pop("completion", 7),
        **kw,
    )


# ---- request mapping --------------------------------------------------------------------------
def test_text_system_and_sampling_map_to_the_canonical_request():
    req = parse(
        body(
            system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            temperature=0.5,
            top_p=0.9,
            top_k=20,
            stop_sequences=["END"],
            metadata={"user_id": "u1"},
            service_tier="auto",
            thinking={"type": "enabled", "budget_tokens": 1024},
        ),
        {},
    )
    assert req.model == "policy" and req.stream is False and req.tool_choice == "auto"
    assert req.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+3?"},
    ]
    assert req.sampling == {
        "max_tokens": 64,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 20,
        "stop": ["END"],
    }
    assert req.tools is None and req.response_format is None


def test_consecutive_turns_of_one_role_are_combined_and_text_blocks_joined():
    req = parse(
        body(
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "user", "content": "c"},
            system="",
        ),
        {},
    )
    assert req.messages == [{"role": "user", "content": "abc"}]


def test_system_messages_inside_messages_are_kept_in_place():
    req = parse(body({"role": "system", "content": "S"}, {"role": "user", "content": "hi"}), {})
    assert req.messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]


def test_images_become_image_url_parts_with_data_urls_next_to_the_text():
    png = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
    inline = {"type": "url", "url": "data:image/jpeg;base64,/9j/4AAQ"}
    content = [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": png},
        {"type": "image", "source": inline},
    ]
    req = parse(body({"role": "user", "content": content}), {})
    assert req.messages[0]["content"] == [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/4AAQ"}},
    ]


def test_an_image_url_is_refused_naming_the_block():
    remote = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.jpg"}}
    with pytest.raises(GatewayHTTPError) as info:
        parse(body({"role": "user", "content": [{"type": "text", "text": "x"}, remote]}), {})
    assert info.value.status == 400 and info.value.param == "messages.0.content.1"
    assert "does not fetch image URLs" in info.value.message


def test_tool_use_and_tool_result_map_to_tool_calls_and_tool_messages_in_order():
    assistant = {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "Two calls.", "signature": "sig"},
            {"type": "text", "text": "Let me compute."},
            {"type": "tool_use", "id": "t1", "name": "calculator", "input": {"expression": "2+3"}},
            {"type": "tool_use", "id": "t2", "name": "calculator", "input": {"expression": "4*5"}},
        ],
    }
    user = {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "5"},
            {
                "type": "tool_result",
                "tool_use_id": "t2",
                "is_error": True,
                "content": [
                    {"type": "text", "text": "error: "},
                    {"type": "text", "text": "overflow"},
                ],
            },
            {"type": "text", "text": "Now add them."},
        ],
    }
    req = parse(body({"role": "user", "content": "Compute."}, assistant, user, tools=[CALC]), {})
    assert req.messages[1] == {
        "role": "assistant",
        "content": "Let me compute.",
        "reasoning_content": "Two calls.",
        "tool_calls": [
            {
                "id": "t1",
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": "2+3"}},
            },
            {
                "id": "t2",
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": "4*5"}},
            },
        ],
    }
    assert req.messages[2:] == [
        {"role": "tool", "tool_call_id": "t1", "content": "5"},
        {
            "role": "tool",
            "tool_call_id": "t2",
            "content": "error: overflow",
        },  # is_error: kept as sent
        {"role": "user", "content": "Now add them."},
    ]
    assert req.tools == [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": CALC["description"],
                "parameters": CALC["input_schema"],
            },
        }
    ]


def test_a_tool_result_without_content_is_an_empty_tool_message():
    req = parse(
        body(
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "calculator", "input": {}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
        ),
        {},
    )
    assert req.messages[1]["content"] == ""
    assert req.messages[-1] == {"role": "tool", "tool_call_id": "t1", "content": ""}


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "auto", "disable_parallel_tool_use": True}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "any"}, "required"),
        (
            {"type": "tool", "name": "calculator", "disable_parallel_tool_use": False},
            {"type": "function", "name": "calculator"},
        ),
    ],
)
def test_tool_choice_maps_to_the_canonical_choice(choice, expected):
    assert parse(body(tools=[CALC], tool_choice=choice), {}).tool_choice == expected


def test_output_config_format_maps_to_response_format_and_stream_is_kept():
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}}
    req = parse(
        body(
            stream=True,
            output_config={"effort": "low", "format": {"type": "json_schema", "schema": schema}},
        ),
        {},
    )
    assert req.stream is True
    assert req.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }


def test_count_tokens_takes_the_same_body_without_max_tokens():
    b = body(tools=[CALC])
    del b["max_tokens"]
    req = parse_count_tokens(b, {})
    assert req.sampling == {} and req.stream is False and req.messages[0]["role"] == "user"
    assert count_tokens_body(42) == {"input_tokens": 42}
    assert DIALECT.name == "messages" and DIALECT.path == "/messages"


# ---- refusals ---------------------------------------------------------------------------------
def _with(**changes: Any) -> dict[str, Any]:
    b = body()
    for key, value in changes.items():
        if value is None:
            b.pop(key, None)
        else:
            b[key] = value
    return b


_USE = {
    "role": "assistant",
    "content": [
        {"type": "tool_use", "id": "t1", "name": "calculator", "input": {"expression": "1"}}
    ],
}
_Q = {"role": "user", "content": "q"}
_IMG = {"type": "base64", "media_type": "image/png", "data": "AAAA"}

HOSTILE: list[tuple[str, Any]] = [
    ("not an object", ["model", "policy"]),
    ("no model", _with(model=None)),
    ("model not a string", _with(model=5)),
    ("no max_tokens", _with(max_tokens=None)),
    ("max_tokens 0", _with(max_tokens=0)),
    ("max_tokens a string", _with(max_tokens="5")),
    ("max_tokens a bool", _with(max_tokens=True)),
    ("max_tokens huge", _with(max_tokens=2**70)),
    ("no messages", _with(messages=None)),
    ("empty messages", _with(messages=[])),
    ("messages a string", _with(messages="hi")),
    ("message not an object", _with(messages=["hi"])),
    ("unknown role", _with(messages=[{"role": "tool", "content": "x"}])),
    (
        "first message from the assistant",
        _with(messages=[{"role": "assistant", "content": "a"}, _Q]),
    ),
    (
        "last message from the assistant (prefill)",
        _with(messages=[_Q, {"role": "assistant", "content": "a"}]),
    ),
    ("content a number", _with(messages=[{"role": "user", "content": 5}])),
    ("content missing", _with(messages=[{"role": "user"}])),
    ("empty user content", _with(messages=[{"role": "user", "content": []}])),
    ("block not an object", _with(messages=[{"role": "user", "content": ["hi"]}])),
    ("unknown block type", _with(messages=[{"role": "user", "content": [{"type": "video"}]}])),
    (
        "document block",
        _with(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "document",
                            "source": {"type": "text", "data": "x", "media_type": "text/plain"},
                        }
                    ],
                }
            ]
        ),
    ),
    ("block without a type", _with(messages=[{"role": "user", "content": [{"text": "x"}]}])),
    (
        "text not a string",
        _with(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
    ),
    (
        "text block nested",
        _with(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": {"type": "text", "text": "x"}}],
                }
            ]
        ),
    ),
    (
        "image in an assistant turn",
        _with(
            messages=[_Q, {"role": "assistant", "content": [{"type": "image", "source": _IMG}]}, _Q]
        ),
    ),
    (
        "tool_use in a user turn",
        _with(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "tool_use", "id": "t", "name": "calculator", "input": {}}],
                }
            ]
        ),
    ),
    (
        "tool_result in an assistant turn",
        _with(
            messages=[
                _Q,
                {
                    "role": "assistant",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "1"}],
                },
                _Q,
            ]
        ),
    ),
    (
        "redacted_thinking",
        _with(
            messages=[
                _Q,
                {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "opaque"}]},
                _Q,
            ]
        ),
    ),
    (
        "thinking without text",
        _with(
            messages=[
                _Q,
                {"role": "assistant", "content": [{"type": "thinking", "signature": "s"}]},
                _Q,
            ]
        ),
    ),
    (
        "tool_use without id",
        _with(
            messages=[
                _Q,
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "name": "calculator", "input": {}}],
                },
                _Q,
            ]
        ),
    ),
    (
        "tool_use input a string",
        _with(
            messages=[
                _Q,
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "t1", "name": "calculator", "input": "{}"}
                    ],
                },
                _Q,
            ]
        ),
    ),
    (
        "tool_use id twice",
        _with(
            messages=[
                _Q,
                _USE,
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "1"}],
                },
                _USE,
                _Q,
            ]
        ),
    ),
    (
        "tool_result for an unknown id",
        _with(
            messages=[
                _Q,
                _USE,
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t9", "content": "1"}],
                },
            ]
        ),
    ),
    (
        "tool_result with no earlier tool_use",
        _with(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "1"}],
                }
            ]
        ),
    ),
    (
        "tool_result after text",
        _with(
            messages=[
                _Q,
                _USE,
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "here:"},
                        {"type": "tool_result", "tool_use_id": "t1", "content": "1"},
                    ],
                },
            ]
        ),
    ),
    (
        "tool_result is_error not a bool",
        _with(
            messages=[
                _Q,
                _USE,
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": "1",
                            "is_error": "yes",
                        }
                    ],
                },
            ]
        ),
    ),
    (
        "tool_result with an image",
        _with(
            messages=[
                _Q,
                _USE,
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "image", "source": _IMG}],
                        }
                    ],
                },
            ]
        ),
    ),
    (
        "tool_result content a number",
        _with(
            messages=[
                _Q,
                _USE,
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": 1}],
                },
            ]
        ),
    ),
    (
        "image media type",
        _with(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {**_IMG, "media_type": "image/bmp"}}],
                }
            ]
        ),
    ),
    (
        "image file source",
        _with(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "file", "file_id": "f1"}}],
                }
            ]
        ),
    ),
    (
        "image without data",
        _with(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png"}}
                    ],
                }
            ]
        ),
    ),
    ("system a number", _with(system=5)),
    ("system with an image", _with(system=[{"type": "image", "source": _IMG}])),
    ("tools not a list", _with(tools={"name": "calculator"})),
    ("server tool", _with(tools=[{"type": "web_search_20250305", "name": "web_search"}])),
    ("bash tool", _with(tools=[{"type": "bash_20250124", "name": "bash"}])),
    ("tool without input_schema", _with(tools=[{"name": "calculator"}])),
    ("tool name with spaces", _with(tools=[{**CALC, "name": "my tool"}])),
    ("tool names twice", _with(tools=[CALC, CALC])),
    ("tool description not a string", _with(tools=[{**CALC, "description": ["x"]}])),
    ("tool_choice a string", _with(tools=[CALC], tool_choice="auto")),
    ("tool_choice tool without name", _with(tools=[CALC], tool_choice={"type": "tool"})),
    ("tool_choice unknown tool", _with(tools=[CALC], tool_choice={"type": "tool", "name": "x"})),
    ("tool_choice any without tools", _with(tool_choice={"type": "any"})),
    ("tool_choice unknown type", _with(tools=[CALC], tool_choice={"type": "required"})),
    (
        "disable_parallel_tool_use not a bool",
        _with(tool_choice={"type": "auto", "disable_parallel_tool_use": "yes"}),
    ),
    ("temperature over 1", _with(temperature=1.5)),
    ("temperature a string", _with(temperature="0.5")),
    ("top_p 0", _with(top_p=0)),
    ("top_k negative", _with(top_k=-1)),
    ("top_k a float", _with(top_k=2.5)),
    ("stop_sequences a string", _with(stop_sequences="END")),
    ("empty stop sequence", _with(stop_sequences=[""])),
    ("too many stop sequences", _with(stop_sequences=[f"s{i}" for i in range(17)])),
    ("stop sequence too long", _with(stop_sequences=["x" * 1001])),
    ("stream not a bool", _with(stream="yes")),
    ("thinking a string", _with(thinking="on")),
    ("thinking budget a string", _with(thinking={"type": "enabled", "budget_tokens": "lots"})),
    ("metadata a list", _with(metadata=["u1"])),
    ("output_config.format text", _with(output_config={"format": {"type": "text"}})),
    ("too many messages", _with(messages=[_Q] * (MAX_MESSAGES + 1))),
]


@pytest.mark.parametrize(("case", "bad"), HOSTILE, ids=[c for c, _ in HOSTILE])
def test_hostile_input_is_a_400_in_anthropics_error_shape(case, bad):
    with pytest.raises(GatewayHTTPError) as info:
        parse(bad, {})
    e = info.value
    assert e.status == 400, case
    shaped = error_body(e)
    assert shaped == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": e.message},
    }
    ErrorResponse.model_validate(shaped)
    assert "Traceback" not in e.message and len(e.message) < 400


def test_errors_name_the_offending_key():
    bad = _with(
        messages=[
            _Q,
            _USE,
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t9", "content": "1"}],
            },
        ]
    )
    with pytest.raises(GatewayHTTPError) as info:
        parse(bad, {})
    assert info.value.param == "messages.2.content.0.tool_use_id"
    assert info.value.message.startswith("messages.2.content.0.tool_use_id: ")
    with pytest.raises(GatewayHTTPError) as info:
        parse(_with(tools=[{"type": "web_search_20250305", "name": "web_search"}]), {})
    assert "only custom tools" in info.value.message and info.value.param == "tools.0.type"


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (409, "invalid_request_error"),
        (413, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (504, "timeout_error"),
        (529, "overloaded_error"),
    ],
)
def test_error_types_follow_the_status(status, kind):
    shaped = error_body(GatewayHTTPError(status, "nope", request_id="req_1"))
    assert shaped == {
        "type": "error",
        "error": {"type": kind, "message": "nope"},
        "request_id": "req_1",
    }
    ErrorResponse.model_validate(shaped)


# ---- the reply: non-streamed and streamed, through the anthropic SDK ---------------------------
async def _events(
    res: TurnResult, pieces: int = 3, fail: GatewayHTTPError | None = None
) -> AsyncIterator[TurnEvent]:
    """The result's reasoning and content as deltas of about ``pieces`` parts each, then the result
    (or ``fail`` raised after the first delta)."""
    for text, kind in (
        (res.message.get("reasoning_content") or "", ReasoningDelta),
        (res.message.get("content") or "", TextDelta),
    ):
        step = max(1, len(text) // pieces)
        for i in range(0, len(text), step):
            yield kind(text[i : i + step])
            if fail is not None:
                raise fail
    yield res


def _sse(res: TurnResult, req: TurnRequest, **kw: Any) -> str:
    async def collect() -> str:
        return "".join([line async for line in DIALECT.render_stream(_events(res, **kw), req, {})])

    return asyncio.run(collect())


class FakeGateway:
    """Answers the SDK's requests from a queue of results, parsing each body with the dialect."""

    def __init__(self, *results: TurnResult) -> None:
        self.results = list(results)
        self.requests: list[TurnRequest] = []
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, http: httpx.Request) -> httpx.Response:
        raw = json.loads(http.content)
        self.bodies.append(raw)
        try:
            req = DIALECT.parse(raw, {})
        except GatewayHTTPError as e:
            return httpx.Response(e.status, json=DIALECT.error_body(e))
        self.requests.append(req)
        res = self.results.pop(0)
        if req.stream:
            return httpx.Response(
                200, text=_sse(res, req), headers={"content-type": "text/event-stream"}
            )
        return httpx.Response(200, json=DIALECT.render(res, req, {}))


def client(handler: Callable[[httpx.Request], httpx.Response]) -> anthropic.Anthropic:
    transport = httpx.MockTransport(handler)
    return anthropic.Anthropic(
        api_key="sk-session",
        base_url="http://gateway/sessions/s1",
        http_client=httpx.Client(transport=transport),
        max_retries=0,
    )


RESULTS = {
    "text": result("Five."),
    "unicode": result("Ünïcödé ✓ 五"),
    "reasoning and text": result("5", reasoning_content="2+3 is 5."),
    "text and a call": result("Let me check.", "tool_calls", tool_calls=[call("call_a", "2+3")]),
    "two calls": result(
        None, "tool_calls", tool_calls=[call("call_a", "2+3"), call("call_b", "4")]
    ),
    "reasoning and a call": result(
        None, "tool_calls", tool_calls=[call("call_a", "2+3")], reasoning_content="Use the tool."
    ),
    "length": result("Five and", "length"),
    "stop sequence": result("Five", stop_sequence="END"),
    "empty": result("", "length", completion=0),
}


@pytest.mark.parametrize("name", list(RESULTS))
def test_streamed_equals_non_streamed_through_the_sdk(name):
    res = RESULTS[name]
    gw = FakeGateway(res, res)
    sdk = client(gw)
    msg = sdk.messages.create(model="policy", max_tokens=64, messages=[_Q])
    with sdk.messages.stream(model="policy", max_tokens=64, messages=[_Q]) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert gw.requests[0].stream is False and gw.requests[1].stream is True
    assert final.model_dump(exclude={"id"}) == msg.model_dump(exclude={"id"})
    assert "".join(texts) == (res.message["content"] or "")
    assert final.id.startswith("msg_") and msg.id.startswith("msg_")


def test_the_rendered_message():
    req = parse(body(), {})
    res = result(
        "Let me check.",
        "tool_calls",
        tool_calls=[call("call_a", "2+3")],
        reasoning_content="Use the tool.",
        prompt=30,
        completion=12,
    )
    out = DIALECT.render(res, req, {})
    assert out["id"].startswith("msg_")
    assert {k: v for k, v in out.items() if k != "id"} == {
        "type": "message",
        "role": "assistant",
        "model": "policy",
        "content": [
            {
                "type": "thinking",
                "thinking": "Use the tool.",
                "signature": thinking_signature("Use the tool."),
            },
            {"type": "text", "text": "Let me check."},
            {
                "type": "tool_use",
                "id": "call_a",
                "name": "calculator",
                "input": {"expression": "2+3"},
            },
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 30,
            "output_tokens": 12,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }
    Message.model_validate(out)


@pytest.mark.parametrize(
    ("res", "reason", "sequence"),
    [
        (result("a"), "end_turn", None),
        (result("a", stop_sequence="END"), "stop_sequence", "END"),
        (result("a", "length"), "max_tokens", None),
        (result(None, "tool_calls", tool_calls=[call("c", "1")]), "tool_use", None),
    ],
)
def test_stop_reason_is_exactly_one_of_anthropics(res, reason, sequence):
    out = DIALECT.render(res, parse(body(), {}), {})
    assert (out["stop_reason"], out["stop_sequence"]) == (reason, sequence)


def test_every_streamed_event_is_an_sdk_event_and_the_stream_is_well_formed():
    res = result(
        "Checking.",
        "tool_calls",
        tool_calls=[call("call_a", "2+3")],
        reasoning_content="Use the tool.",
    )
    text = _sse(res, parse(body(stream=True), {}))
    frames = [f for f in text.split("\n\n") if f]
    types = []
    for frame in frames:
        event_line, data_line = frame.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}"
        types.append(data["type"])
        if data["type"] != "ping":
            EVENTS.validate_python(data)
    assert types[:2] == ["message_start", "ping"] and types[-2:] == [
        "message_delta",
        "message_stop",
    ]
    starts = [json.loads(f.split("\n")[1][6:]) for f in frames if "content_block_start" in f]
    assert [s["content_block"]["type"] for s in starts] == ["thinking", "text", "tool_use"]
    assert [s["index"] for s in starts] == [0, 1, 2]
    assert types.count("content_block_stop") == 3
    assert '"signature_delta"' in text and '"input_json_delta"' in text


def test_an_error_mid_stream_is_an_error_event_the_sdk_raises():
    fail = GatewayHTTPError(
        502,
        "the inference engine failed (nothing was recorded)",
        type_="server_error",
        request_id="req_9",
    )
    text = _sse(result("Five."), parse(body(stream=True), {}), fail=fail)
    last = text.strip().split("\n\n")[-1]
    assert last.startswith("event: error\n")
    data = json.loads(last.split("\n")[1][6:])
    assert data == {
        "type": "error",
        "error": {"type": "api_error", "message": fail.message},
        "request_id": "req_9",
    }

    def handler(http: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    with (
        pytest.raises(anthropic.APIStatusError, match="inference engine failed"),
        client(handler).messages.stream(model="p", max_tokens=8, messages=[_Q]) as stream,
    ):
        stream.get_final_message()


def test_a_stream_without_a_result_ends_with_an_error_event():
    async def nothing() -> AsyncIterator[TurnEvent]:
        yield TextDelta("Fi")

    async def collect() -> list[str]:
        return [x async for x in DIALECT.render_stream(nothing(), parse(body(), {}), {})]

    last = asyncio.run(collect())[-1]
    assert last.startswith("event: error\n") and '"api_error"' in last


@pytest.mark.parametrize(
    ("status", "exc"),
    [
        (400, anthropic.BadRequestError),
        (401, anthropic.AuthenticationError),
        (404, anthropic.NotFoundError),
        (409, anthropic.ConflictError),
        (503, anthropic.InternalServerError),
    ],
)
def test_the_sdk_raises_its_own_error_classes(status, exc):
    def handler(http: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json=error_body(GatewayHTTPError(status, "no")))

    with pytest.raises(exc) as info:
        client(handler).messages.create(model="p", max_tokens=8, messages=[_Q])
    assert info.value.body["type"] == "error" and info.value.body["error"]["message"] == "no"


def test_a_refused_request_reaches_the_sdk_as_bad_request():
    gw = FakeGateway()
    with pytest.raises(anthropic.BadRequestError, match="only custom tools"):
        client(gw).messages.create(
            model="p",
            max_tokens=8,
            messages=[_Q],
            tools=[{"type": "web_search_20250305", "name": "web_search"}],
        )
    assert gw.requests == []


def test_count_tokens_through_the_sdk():
    seen: list[TurnRequest] = []

    def handler(http: httpx.Request) -> httpx.Response:
        assert http.url.path == "/sessions/s1/v1/messages/count_tokens"
        seen.append(parse_count_tokens(json.loads(http.content), {}))
        return httpx.Response(200, json=count_tokens_body(17))

    out = client(handler).messages.count_tokens(model="p", messages=[_Q], tools=[CALC])
    assert isinstance(out, MessageTokensCount) and out.input_tokens == 17
    assert seen[0].tools is not None and seen[0].messages == [{"role": "user", "content": "q"}]


# ---- a tool loop: tool_use -> tool_result -> answer --------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_tool_result_answer_round_trip(stream):
    """The assistant turn the SDK sends back is, canonically, the turn the gateway returned (so the
    session's trie continues the sampled branch), and the tool result follows it."""
    first = result(
        None, "tool_calls", tool_calls=[call("call_a", "2+3")], reasoning_content="Add them."
    )
    gw = FakeGateway(first, result("The answer is 5."))
    sdk = client(gw)
    messages: list[Any] = [{"role": "user", "content": "What is 2+3?"}]
    for _ in range(3):
        if stream:
            with sdk.messages.stream(
                model="p", max_tokens=64, messages=messages, tools=[CALC]
            ) as s:
                reply = s.get_final_message()
        else:
            reply = sdk.messages.create(model="p", max_tokens=64, messages=messages, tools=[CALC])
        messages.append(reply.to_param())
        if reply.stop_reason != "tool_use":
            break
        results = [
            {"type": "tool_result", "tool_use_id": b.id, "content": "5"}
            for b in reply.content
            if b.type == "tool_use"
        ]
        messages.append({"role": "user", "content": results})
    assert reply.content[0].type == "text" and reply.content[0].text == "The answer is 5."
    second = gw.requests[1]
    echoed = second.messages[1]
    assert canonical_message(echoed) == canonical_message(first.message)
    assert echoed["reasoning_content"] == "Add them." and echoed["tool_calls"][0]["id"] == "call_a"
    assert second.messages[2] == {"role": "tool", "tool_call_id": "call_a", "content": "5"}
    assert gw.bodies[1]["messages"][1]["content"][0]["signature"] == thinking_signature("Add them.")
