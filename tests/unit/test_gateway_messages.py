"""The Anthropic Messages dialect (agentloop.gateway.dialects.messages): how a request maps to
the canonical TurnRequest, and every refusal a 400 in Anthropic's error shape (checked with the
anthropic SDK's models).  The reply side and the SDK end to end: test_gateway_messages_sdk.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from anthropic.types.shared.error_response import ErrorResponse

from agentloop.gateway.dialects.messages import (
    DIALECT,
    MAX_MESSAGES,
    count_tokens_body,
    parse,
    parse_count_tokens,
)
from agentloop.gateway.dialects.messages_stream import error_body
from agentloop.gateway.protocol import GatewayHTTPError
from agentloop.gateway.turn import TurnResult

CALC = {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}},
}


def body(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A Messages request body (a single user question when no messages are given)."""
    msgs = list(messages) or [{"role": "user", "content": "What is 2+3?"}]
    return {"model": "policy", "max_tokens": 64, "messages": msgs, **extra}


def call(call_id: str, expression: str) -> dict[str, Any]:
    """A canonical tool call as the decoder returns it (arguments: the JSON the model wrote)."""
    args = json.dumps({"expression": expression})
    return {
        "id": call_id, "type": "function", "function": {"name": "calculator", "arguments": args},
    }


def result(content: str | None = "", finish: str = "stop", **kw: Any) -> TurnResult:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    for key in ("tool_calls", "reasoning_content"):
        if key in kw:
            message[key] = kw.pop(key)
    return TurnResult(
        message=message, finish_reason=finish, prompt_tokens=kw.pop("prompt", 21),
        completion_tokens=kw.pop("completion", 7), **kw,
    )


# ---- request mapping --------------------------------------------------------------------------
def test_text_system_and_sampling_map_to_the_canonical_request():
    req = parse(
        body(
            system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            temperature=0.5, top_p=0.9, top_k=20, stop_sequences=["END"],
            metadata={"user_id": "u1"}, service_tier="auto",
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
        "max_tokens": 64, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "stop": ["END"],
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
        {"type": "text", "text": "What is this?"}, {"type": "image", "source": png},
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
                "id": "t1", "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": "2+3"}},
            },
            {
                "id": "t2", "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": "4*5"}},
            },
        ],
    }
    assert req.messages[2:] == [
        {"role": "tool", "tool_call_id": "t1", "content": "5"},
        {
            "role": "tool", "tool_call_id": "t2", "content": "error: overflow",
        },  # is_error: kept as sent
        {"role": "user", "content": "Now add them."},
    ]
    assert req.tools == [
        {
            "type": "function",
            "function": {
                "name": "calculator", "description": CALC["description"],
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
    """The default body with keys replaced (None: removed)."""
    b = body()
    for key, value in changes.items():
        if value is None:
            b.pop(key, None)
        else:
            b[key] = value
    return b


def user(*blocks: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(blocks)}


def asst(*blocks: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": list(blocks)}


def convo(*messages: dict[str, Any]) -> dict[str, Any]:
    return _with(messages=list(messages))


_Q = {"role": "user", "content": "q"}
_IMG = {"type": "base64", "media_type": "image/png", "data": "AAAA"}
_USE = asst({"type": "tool_use", "id": "t1", "name": "calculator", "input": {"expression": "1"}})
_RESULT = {"type": "tool_result", "tool_use_id": "t1", "content": "1"}
_DOC = {"type": "document", "source": {"type": "text", "data": "x", "media_type": "text/plain"}}

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
    ("unknown role", convo({"role": "tool", "content": "x"})),
    ("first message from the assistant", convo({"role": "assistant", "content": "a"}, _Q)),
    ("last message from the assistant", convo(_Q, {"role": "assistant", "content": "a"})),
    ("content a number", convo({"role": "user", "content": 5})),
    ("content missing", convo({"role": "user"})),
    ("empty user content", convo(user())),
    ("block not an object", convo(user("hi"))),
    ("unknown block type", convo(user({"type": "video"}))),
    ("document block", convo(user(_DOC))),
    ("block without a type", convo(user({"text": "x"}))),
    ("text not a string", convo(user({"type": "text", "text": 5}))),
    ("text block nested", convo(user({"type": "text", "text": {"type": "text", "text": "x"}}))),
    ("image in an assistant turn", convo(_Q, asst({"type": "image", "source": _IMG}), _Q)),
    ("tool_use in a user turn", convo(user(_USE["content"][0]))),
    ("tool_result in an assistant turn", convo(_Q, asst(_RESULT), _Q)),
    ("redacted_thinking", convo(_Q, asst({"type": "redacted_thinking", "data": "opaque"}), _Q)),
    ("thinking without text", convo(_Q, asst({"type": "thinking", "signature": "s"}), _Q)),
    ("tool_use without id", convo(_Q, asst({"type": "tool_use", "name": "c", "input": {}}), _Q)),
    ("tool_use input a string", convo(_Q, asst({**_USE["content"][0], "input": "{}"}), _Q)),
    ("tool_use id twice", convo(_Q, _USE, user(_RESULT), _USE, _Q)),
    ("tool_result for an unknown id", convo(_Q, _USE, user({**_RESULT, "tool_use_id": "t9"}))),
    ("tool_result with no earlier tool_use", convo(user(_RESULT))),
    ("tool_result after text", convo(_Q, _USE, user({"type": "text", "text": "x"}, _RESULT))),
    ("is_error not a bool", convo(_Q, _USE, user({**_RESULT, "is_error": "yes"}))),
    ("tool_result with an image", convo(_Q, _USE, user(
        {**_RESULT, "content": [{"type": "image", "source": _IMG}]}))),
    ("tool_result content a number", convo(_Q, _USE, user({**_RESULT, "content": 1}))),
    ("tool_result content nested", convo(_Q, _USE, user({**_RESULT, "content": [_RESULT]}))),
    ("image media type", convo(user({"type": "image", "source": {**_IMG,
                                                                  "media_type": "image/bmp"}}))),
    ("image file source", convo(user({"type": "image", "source": {"type": "file",
                                                                   "file_id": "f1"}}))),
    ("image without data", convo(user({"type": "image", "source": {"type": "base64",
                                                                    "media_type": "image/png"}}))),
    ("image data not base64 text", convo(user({"type": "image", "source": {**_IMG, "data": 5}}))),
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
    ("disable_parallel_tool_use not a bool",
     _with(tool_choice={"type": "auto", "disable_parallel_tool_use": "yes"})),
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
        (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
        (404, "not_found_error"), (409, "invalid_request_error"), (413, "invalid_request_error"),
        (429, "rate_limit_error"), (500, "api_error"), (502, "api_error"),
        (503, "overloaded_error"), (504, "timeout_error"), (529, "overloaded_error"),
    ],
)
def test_error_types_follow_the_status(status, kind):
    shaped = error_body(GatewayHTTPError(status, "nope", request_id="req_1"))
    assert shaped == {
        "type": "error", "error": {"type": kind, "message": "nope"}, "request_id": "req_1",
    }
    ErrorResponse.model_validate(shaped)
