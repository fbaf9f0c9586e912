"""The Anthropic Messages dialect's reply side with the anthropic SDK's own client and models: the
rendered message, its event stream (streamed == non-streamed through ``messages.stream``), errors,
count_tokens and a tool loop, first over an httpx mock transport (no gateway), then against a
live gateway on loopback (fake engine, real tokenizer): exact trajectories; refusals record
nothing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anthropic
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from gateway_helpers import CALC_TOOL, LiveGateway, full_render_ids
from pydantic import TypeAdapter
from test_gateway_messages import CALC, body, call, result

from agentloop.gateway.dialects.messages import (
    DIALECT,
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

EVENTS = TypeAdapter(RawMessageStreamEvent)
_Q = {"role": "user", "content": "q"}


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
        api_key="sk-session", base_url="http://gateway/sessions/s1",
        http_client=httpx.Client(transport=transport), max_retries=0,
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
        "Let me check.", "tool_calls", tool_calls=[call("call_a", "2+3")],
        reasoning_content="Use the tool.", prompt=30, completion=12,
    )
    out = DIALECT.render(res, req, {})
    assert out["id"].startswith("msg_")
    assert {k: v for k, v in out.items() if k != "id"} == {
        "type": "message",
        "role": "assistant",
        "model": "policy",
        "content": [
            {
                "type": "thinking", "thinking": "Use the tool.",
                "signature": thinking_signature("Use the tool."),
            },
            {"type": "text", "text": "Let me check."},
            {
                "type": "tool_use", "id": "call_a", "name": "calculator",
                "input": {"expression": "2+3"},
            },
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 30, "output_tokens": 12, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }
    Message.model_validate(out)


@pytest.mark.parametrize(
    ("res", "reason", "sequence"),
    [
        (result("a"), "end_turn", None), (result("a", stop_sequence="END"), "stop_sequence", "END"),
        (result("a", "length"), "max_tokens", None),
        (result(None, "tool_calls", tool_calls=[call("c", "1")]), "tool_use", None),
    ],
)
def test_stop_reason_is_exactly_one_of_anthropics(res, reason, sequence):
    out = DIALECT.render(res, parse(body(), {}), {})
    assert (out["stop_reason"], out["stop_sequence"]) == (reason, sequence)


def test_every_streamed_event_is_an_sdk_event_and_the_stream_is_well_formed():
    res = result(
        "Checking.", "tool_calls", tool_calls=[call("call_a", "2+3")],
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
        502, "the inference engine failed (nothing was recorded)", type_="server_error",
        request_id="req_9",
    )
    text = _sse(result("Five."), parse(body(stream=True), {}), fail=fail)
    last = text.strip().split("\n\n")[-1]
    assert last.startswith("event: error\n")
    data = json.loads(last.split("\n")[1][6:])
    assert data == {
        "type": "error", "error": {"type": "api_error", "message": fail.message},
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
        (400, anthropic.BadRequestError), (401, anthropic.AuthenticationError),
        (404, anthropic.NotFoundError), (409, anthropic.ConflictError),
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
            model="p", max_tokens=8, messages=[_Q],
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


# ---- the anthropic SDK against a live gateway (loopback HTTP, fake engine, real tokenizer) -----
@pytest.fixture(scope="module")
def live() -> Any:
    from transformers import AutoTokenizer

    from agentloop.testing.tiny_model import ensure_tiny_model

    gw = LiveGateway(AutoTokenizer.from_pretrained(str(ensure_tiny_model())))
    yield gw
    gw.close()


_LIVE_TOOL = {"name": CALC_TOOL["function"]["name"],
              "description": CALC_TOOL["function"]["description"],
              "input_schema": CALC_TOOL["function"]["parameters"]}


def sdk_calculator(sdk: anthropic.Anthropic, question: str, stream: bool) -> list[dict[str, Any]]:
    """Plain anthropic-SDK agent code; returns the conversation (chat form) the client saw."""
    messages: list[Any] = [{"role": "user", "content": question}]
    chat: list[dict[str, Any]] = [{"role": "system", "content": "You are a calculator."},
                                  {"role": "user", "content": question}]
    kwargs = {"model": "m", "max_tokens": 64, "system": "You are a calculator.",
              "tools": [_LIVE_TOOL]}
    for _ in range(4):
        if stream:
            with sdk.messages.stream(messages=messages, **kwargs) as s:
                reply = s.get_final_message()
        else:
            reply = sdk.messages.create(messages=messages, **kwargs)
        messages.append(reply.to_param())
        text = "".join(b.text for b in reply.content if b.type == "text")
        uses = [b for b in reply.content if b.type == "tool_use"]
        turn: dict[str, Any] = {"role": "assistant", "content": text}
        if uses:
            turn["tool_calls"] = [{"id": b.id, "type": "function", "function": {
                "name": b.name, "arguments": b.input}} for b in uses]
        chat.append(turn)
        if reply.stop_reason != "tool_use":
            return chat
        pairs = [(b.id, str(eval(b.input["expression"], {}))) for b in uses]  # noqa: S307
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": i, "content": r} for i, r in pairs]})
        chat += [{"role": "tool", "tool_call_id": i, "content": r} for i, r in pairs]
    return chat


@pytest.mark.parametrize("stream", [False, True])
def test_an_sdk_tool_loop_records_exactly_what_the_client_received(live, stream):
    trajectories = []
    for root in ("session", "v1"):  # base_url: the session root, or the OpenAI-style .../v1 base
        handle = live.session()
        base = handle.base_url.removesuffix("/v1") if root == "session" else handle.base_url
        sdk = anthropic.Anthropic(base_url=base, api_key=handle.api_key, max_retries=0, timeout=30)
        chat = sdk_calculator(sdk, "What is 6*7?", stream)
        assert chat[2]["tool_calls"][0]["function"]["arguments"] == {"expression": "6*7"}
        assert chat[-1]["content"] == "The answer is 42."
        (traj,) = live.finalize(handle.session_id)["trajectories"]
        sep = live.tokenizer.encode("\n", add_special_tokens=False)
        ids = list(traj.prompt_ids) + list(traj.response_ids)
        assert ids + sep == full_render_ids(live.tokenizer, chat, [CALC_TOOL])
        trajectories.append(ids)
    assert trajectories[0] == trajectories[1]


def test_refused_sdk_requests_record_nothing(live):
    handle = live.session()
    sdk = anthropic.Anthropic(base_url=handle.base_url, api_key=handle.api_key, max_retries=0)
    bad_calls = [
        {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
        {"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"}]}]},
        {"messages": [_Q], "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        {"messages": [_Q], "extra_body": {"temperature": 3}},  # the SDK has no sampling knobs
    ]
    for kwargs in bad_calls:
        with pytest.raises(anthropic.BadRequestError) as info:
            sdk.messages.create(model="m", max_tokens=8, **kwargs)
        assert info.value.body["error"]["type"] == "invalid_request_error"
    wrong = anthropic.Anthropic(base_url=handle.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model="m", max_tokens=8, messages=[_Q])
    done = live.finalize(handle.session_id)
    assert done["trajectories"] == [] and done["stats"]["num_requests"] == 0
