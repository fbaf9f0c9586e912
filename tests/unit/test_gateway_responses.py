"""The OpenAI Responses API dialect (agentloop/gateway/dialects/responses*.py), without an engine.

Parse (every input item kind, tools, tool_choice, text.format, refusals), render (checked with the
openai SDK's own ``Response`` model), the event stream (every event checked with the SDK's
stream-event union; it ends with the non-streamed body), ``previous_response_id`` chains (stored and
``store: false``), and the openai SDK / openai-agents clients talking to the dialect through an
in-memory HTTP transport.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
import pytest
from gateway_helpers import CALC_TOOL, LiveGateway, full_render_ids
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from agentloop.gateway.dialects.responses import DIALECT
from agentloop.gateway.protocol import GatewayHTTPError
from agentloop.gateway.store import canonical_message
from agentloop.gateway.turn import ReasoningDelta, TextDelta, TurnEvent, TurnRequest, TurnResult

CALC = {"type": "function", "name": "calculator", "description": "Evaluate arithmetic.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


def parse(body: dict[str, Any], state: dict[str, Any] | None = None) -> TurnRequest:
    return DIALECT.parse(body, {} if state is None else state)


def refused(body: Any, state: dict[str, Any] | None = None) -> GatewayHTTPError:
    with pytest.raises(GatewayHTTPError) as info:
        DIALECT.parse(body, {} if state is None else state)
    assert info.value.status == 400
    assert set(DIALECT.error_body(info.value)["error"]) >= {"message", "type", "param", "code"}
    return info.value


def call(call_id: str, name: str = "calculator",
         args: str = '{"expression": "2+3"}') -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def result(content: str | None = "", *, calls: tuple[dict[str, Any], ...] = (),
           reasoning: str | None = None, finish: str | None = None) -> TurnResult:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = list(calls)
    if reasoning:
        message["reasoning_content"] = reasoning
    finish = finish or ("tool_calls" if calls else "stop")
    return TurnResult(message=message, finish_reason=finish, prompt_tokens=12, completion_tokens=7)


async def _events(items: list[TurnEvent | Exception]) -> AsyncIterator[TurnEvent]:
    for item in items:
        if isinstance(item, Exception):
            raise item
        yield item


def stream(request: TurnRequest, items: list[Any], state: dict[str, Any] | None = None
           ) -> list[dict[str, Any]]:
    """The streamed events as dicts; checks the SSE framing and the SDK's event union."""

    async def collect() -> list[str]:
        gen = DIALECT.render_stream(_events(items), request, {} if state is None else state)
        return [line async for line in gen]

    events = []
    for n, chunk in enumerate(asyncio.run(collect())):
        head, data, *rest = chunk.split("\n")
        assert rest == ["", ""] and head.startswith("event: ") and data.startswith("data: ")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}" and event["sequence_number"] == n
        STREAM_EVENT.validate_python(event)
        events.append(event)
    return events


def canon(messages: list[dict[str, Any]]) -> list[Any]:
    return [canonical_message(m) for m in messages]


# ---- parse: input items ----------------------------------------------------------------------
def test_string_input_and_instructions_become_system_and_user_messages():
    req = parse({"model": "m", "instructions": "Be brief.", "input": "Hi"})
    assert req.messages == [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Hi"}]
    assert req.model == "m" and req.tools is None and req.tool_choice == "auto" and not req.stream


def test_message_items_with_text_parts_and_every_role():
    req = parse({"input": [
        {"role": "developer", "content": "dev"},
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "sys"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                     {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "ok", "annotations": []},
                     {"type": "refusal", "refusal": "!"}]},
        {"role": "user", "content": "next"},
    ]})
    assert req.messages == [
        {"role": "developer", "content": "dev"}, {"role": "system", "content": "sys"},
        {"role": "user", "content": "ab"}, {"role": "assistant", "content": "ok!"},
        {"role": "user", "content": "next"},
    ]


def test_reasoning_text_and_function_calls_merge_into_one_assistant_message():
    req = parse({"tools": [CALC], "input": [
        {"role": "user", "content": "2+3 and 4*5?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "two calls"}]},
        {"role": "assistant", "content": "Let me compute."},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "calculator",
         "arguments": '{"expression": "2+3"}', "status": "completed"},
        {"type": "function_call", "call_id": "c2", "name": "calculator", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "5"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "2"}, {"type": "input_text", "text": "0"}]},
    ]})
    assert req.messages[1] == {
        "role": "assistant", "content": "Let me compute.", "reasoning_content": "two calls",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calculator",
                                                         "arguments": {"expression": "2+3"}}},
            {"id": "c2", "type": "function", "function": {"name": "calculator", "arguments": {}}}]}
    assert req.messages[2:] == [{"role": "tool", "content": "5", "tool_call_id": "c1"},
                                {"role": "tool", "content": "20", "tool_call_id": "c2"}]


def test_item_boundaries_start_new_assistant_messages():
    req = parse({"input": [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "one"},
        {"role": "assistant", "content": "two"},  # a second text: a new message
        {"type": "reasoning", "id": "r", "summary": [{"type": "summary_text", "text": "s1"},
                                                     {"type": "summary_text", "text": "s2"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "reasoning", "id": "r2", "summary": [], "encrypted_content": "opaque"},  # no text
        {"type": "function_call_output", "call_id": "c", "output": "x"},
    ]})
    roles = [(m["role"], m.get("content"), m.get("reasoning_content")) for m in req.messages]
    assert roles == [("user", "u", None), ("assistant", "one", None), ("assistant", "two", None),
                     ("assistant", "", "s1\n\ns2"), ("tool", "x", None)]
    assert req.messages[3]["tool_calls"][0]["id"] == "c"


def test_input_image_becomes_a_chat_image_part_or_a_400_naming_the_item():
    body = {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"},
        {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=",
         "detail": "auto"}]}]}
    try:
        req = parse(body)
    except GatewayHTTPError as e:  # the chat path refuses images until the images work lands
        assert e.status == 400 and e.param is not None and e.param.startswith("input.0")
        assert "input[0]" in e.message
    else:
        parts = req.messages[0]["content"]
        assert {"type": "text", "text": "what is this?"} in parts
        assert any(p.get("type") == "image_url" for p in parts)


# ---- parse: tools, tool_choice, text.format, sampling, options -------------------------------
def test_function_tools_map_to_chat_tools_and_are_echoed_flat():
    req = parse({"input": "x", "tools": [CALC, {"type": "function", "name": "noop"}]})
    assert req.tools == [
        {"type": "function", "function": {"name": "calculator",
                                          "description": "Evaluate arithmetic.",
                                          "parameters": CALC["parameters"]}},
        {"type": "function", "function": {"name": "noop"}}]
    assert req.extra["echo"]["tools"][1] == {"type": "function", "name": "noop",
                                             "description": None, "parameters": None,
                                             "strict": None}


@pytest.mark.parametrize("tool", [
    {"type": "web_search"}, {"type": "file_search", "vector_store_ids": []},
    {"type": "computer_use_preview"}, {"type": "mcp", "server_label": "x"},
    {"type": "custom", "name": "x"},
])
def test_hosted_and_custom_tools_are_refused(tool):
    error = refused({"input": "x", "tools": [tool]})
    assert "only function tools" in error.message and error.param == "tools.0.type"


@pytest.mark.parametrize(("choice", "expected"), [
    (None, "auto"), ("auto", "auto"), ("none", "none"), ("required", "required"),
    ({"type": "function", "name": "calculator"}, {"type": "function", "name": "calculator"}),
])
def test_tool_choice_maps_to_the_canonical_request(choice, expected):
    body: dict[str, Any] = {"input": "x", "tools": [CALC]}
    if choice is not None:
        body["tool_choice"] = choice
    req = parse(body)
    assert req.tool_choice == expected and req.extra["echo"]["tool_choice"] == expected


@pytest.mark.parametrize("choice", [
    {"type": "function", "name": "other"}, {"type": "allowed_tools", "mode": "auto", "tools": []},
    {"type": "web_search_preview"}, "sometimes",
])
def test_unservable_tool_choice_is_refused(choice):
    assert refused({"input": "x", "tools": [CALC], "tool_choice": choice}).param == "tool_choice"


def test_required_tool_choice_without_tools_is_refused():
    assert refused({"input": "x", "tool_choice": "required"}).param == "tool_choice"


def test_text_format_maps_to_the_chat_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "A", "schema": schema, "strict": True}
    req = parse({"input": "x", "text": {"format": fmt}})
    assert req.response_format == {"type": "json_schema",
                                   "json_schema": {"name": "A", "schema": schema, "strict": True}}
    assert parse({"input": "x", "text": {"format": {"type": "json_object"}}}).response_format == {
        "type": "json_object"}
    plain = parse({"input": "x", "text": {"format": {"type": "text"}, "verbosity": "low"}})
    assert plain.response_format is None
    assert plain.extra["echo"]["text"] == {"format": {"type": "text"}, "verbosity": "low"}
    for fmt in ({"type": "json_schema", "name": "A"}, {"type": "grammar"}, "json"):
        assert refused({"input": "x", "text": {"format": fmt}}).param == "text.format"


def test_sampling_keys_and_accepted_options():
    req = parse({"input": "x", "temperature": 0.5, "top_p": 0.9, "max_output_tokens": 64,
                 "parallel_tool_calls": False, "include": ["reasoning.encrypted_content"],
                 "metadata": {"k": "v"}, "user": "u", "truncation": "disabled",
                 "service_tier": "auto", "reasoning": {"effort": "low"}, "top_logprobs": 2,
                 "store": False, "stream": True, "unknown_future_key": 1})
    assert req.sampling == {"temperature": 0.5, "top_p": 0.9, "max_tokens": 64}
    assert req.stream
    echo = req.extra["echo"]
    assert echo["parallel_tool_calls"] is False and echo["store"] is False
    assert echo["metadata"] == {"k": "v"} and echo["reasoning"] == {"effort": "low"}


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "n": 2}, "n"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({}, "input"), ({"input": []}, "input"), ({"input": ""}, "input"),
])
def test_unsupported_options_are_refused(body, param):
    assert refused(body).param == param


# ---- parse: hostile input --------------------------------------------------------------------
@pytest.mark.parametrize(("body", "param"), [
    ([1, 2], None),
    ({"input": 5}, "input"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "top_p": 0}, "top_p"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "tools": {"type": "function"}}, "tools"),
    ({"input": "x", "tools": ["calculator"]}, "tools.0"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools.0.name"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": "{}"}]},
     "tools.0.parameters"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata"),
    ({"input": "x", "instructions": ["a"]}, "instructions"),
    ({"input": "x", "previous_response_id": 7}, "previous_response_id"),
    ({"input": ["hello"]}, "input.0"),
    ({"input": [{"content": "no role or type"}]}, "input.0.type"),
    ({"input": [{"type": "shell_call", "action": {}}]}, "input.0.type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": None}]}, "input.0.content"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
     "input.0.content.0"),
    ({"input": [{"role": "user", "content": [[{"type": "input_text", "text": "nested"}]]}]},
     "input.0.content.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input.0.content.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input.0.content.0"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]},
     "input.0.arguments"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "", "arguments": "{}"}]},
     "input.0.name"),
    ({"input": [{"type": "function_call_output", "output": "5"}]}, "input.0.call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input.0.output"),
    ({"input": [{"type": "reasoning", "summary": "text"}]}, "input.0.summary"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "reasoning_text", "text": "t"}]}]},
     "input.0.summary.0"),
])
def test_malformed_bodies_and_items_are_400_naming_the_place(body, param):
    assert refused(body).param == param


def test_function_call_output_for_an_unknown_call_id_is_refused():
    error = refused({"input": [
        {"role": "user", "content": "u"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c2", "output": "x"}]})
    assert error.param == "input.2.call_id" and "'c2'" in error.message
    error = refused({"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]})
    assert error.param == "input.0.call_id"


def test_a_call_id_used_twice_is_refused():
    error = refused({"input": [
        {"role": "user", "content": "u"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "x"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]})
    assert error.param == "input.3.call_id"


# ---- render ------------------------------------------------------------------------------------
def test_render_is_a_response_the_sdk_accepts_with_every_item_kind():
    req = parse({"model": "m", "instructions": "I", "input": "2+3?", "tools": [CALC],
                 "temperature": 0.3})
    calls = (call("c1"), call("c2", args='{"expression": "1"}'))
    body = DIALECT.render(result("Let me see.", calls=calls, reasoning="think"), req, {})
    response = Response.model_validate(body)
    assert response.id == req.extra["response_id"] and response.id.startswith("resp_")
    assert response.status == "completed" and response.incomplete_details is None
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call",
                                                       "function_call"]
    assert response.output[0].content[0].text == "think"
    assert response.output_text == "Let me see."
    items = [(o.id, o.call_id, o.name, o.arguments, o.status) for o in response.output[2:]]
    suffix = response.id.removeprefix("resp_")
    assert items == [(f"fc_{suffix}_0", "c1", "calculator", '{"expression": "2+3"}', "completed"),
                     (f"fc_{suffix}_1", "c2", "calculator", '{"expression": "1"}', "completed")]
    assert response.usage is not None
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (12, 7, 19)
    assert response.instructions == "I" and response.temperature == 0.3 and response.store is True
    assert response.tools[0].name == "calculator" and response.parallel_tool_calls is True


def test_render_tool_calls_only_has_no_message_item_and_text_only_has_no_calls():
    req = parse({"input": "x", "tools": [CALC]})
    body = DIALECT.render(result(None, calls=(call("c1"),)), req, {})
    assert [o["type"] for o in body["output"]] == ["function_call"]
    body = DIALECT.render(result(""), req, {})
    assert [o["type"] for o in body["output"]] == ["message"]
    Response.model_validate(body)


def test_length_is_incomplete_with_max_output_tokens():
    req = parse({"input": "x", "max_output_tokens": 5})
    response = Response.model_validate(DIALECT.render(result("cut", finish="length"), req, {}))
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.max_output_tokens == 5


# ---- previous_response_id ------------------------------------------------------------------------
def test_previous_response_id_prepends_the_stored_conversation():
    state: dict[str, Any] = {}
    first = parse({"instructions": "I", "input": "2+3?", "tools": [CALC]}, state)
    answer = result(None, calls=(call("c1"),), reasoning="use the tool")
    body = DIALECT.render(answer, first, state)
    output = {"type": "function_call_output", "call_id": "c1", "output": "5"}
    second = parse({"instructions": "I", "tools": [CALC], "previous_response_id": body["id"],
                    "input": [output]}, state)
    assert second.messages[:2] == first.messages
    assert canon(second.messages[2:3]) == canon([answer.message])
    assert second.messages[2]["reasoning_content"] == "use the tool"
    assert second.messages[3] == {"role": "tool", "content": "5", "tool_call_id": "c1"}
    # the same conversation sent statelessly (store: false, the output items echoed) is equal
    echoed = [{"role": "user", "content": "2+3?"}, *body["output"], output]
    stateless = parse({"instructions": "I", "tools": [CALC], "store": False, "input": echoed},
                      state)
    assert stateless.messages == second.messages


def test_chains_grow_and_instructions_are_not_carried_over():
    state: dict[str, Any] = {}
    prev = None
    turns = ["one", "two", "three"]
    for n, text in enumerate(turns):
        body: dict[str, Any] = {"instructions": f"I{n}", "input": text}
        if prev is not None:
            body["previous_response_id"] = prev
        req = parse(body, state)
        prev = DIALECT.render(result(f"re {text}"), req, state)["id"]
    final = parse({"previous_response_id": prev, "input": "four"}, state)
    assert [(m["role"], m["content"]) for m in final.messages] == [
        ("user", "one"), ("assistant", "re one"), ("user", "two"), ("assistant", "re two"),
        ("user", "three"), ("assistant", "re three"), ("user", "four")]


def test_branching_from_one_response_keeps_both_branches():
    state: dict[str, Any] = {}
    root = DIALECT.render(result("A"), parse({"input": "q"}, state), state)["id"]
    b1 = DIALECT.render(result("B1"), parse({"input": "x", "previous_response_id": root}, state),
                        state)
    b2 = DIALECT.render(result("B2"), parse({"input": "y", "previous_response_id": root}, state),
                        state)
    for rid, text in ((b1["id"], "B1"), (b2["id"], "B2")):
        msgs = parse({"input": "z", "previous_response_id": rid}, state).messages
        assert msgs[3]["content"] == text and msgs[:2] == [{"role": "user", "content": "q"},
                                                           {"role": "assistant", "content": "A"}]


def test_unknown_or_unstored_previous_response_id_is_400():
    state: dict[str, Any] = {}
    error = refused({"input": "x", "previous_response_id": "resp_nope"}, state)
    assert error.code == "previous_response_not_found" and error.param == "previous_response_id"
    unstored = DIALECT.render(result("A"), parse({"input": "q", "store": False}, state), state)
    assert state.get("responses", {}) == {}
    error = refused({"input": "x", "previous_response_id": unstored["id"]}, state)
    assert error.code == "previous_response_not_found"


def test_a_failed_request_stores_nothing():
    state: dict[str, Any] = {}
    req = parse({"input": "q"}, state)
    failure = GatewayHTTPError(502, "engine failed", type_="server_error", code="engine_error")
    events = stream(req, [TextDelta("par"), failure], state)
    assert state.get("responses", {}) == {}
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert refused({"input": "x", "previous_response_id": req.extra["response_id"]}, state)


# ---- streaming -----------------------------------------------------------------------------------
def _final(events: list[dict[str, Any]]) -> dict[str, Any]:
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    return events[-1]["response"]


@pytest.mark.parametrize("case", ["text", "reasoning_text_calls", "calls_only", "no_deltas",
                                  "length", "reasoning_after_text"])
def test_stream_ends_with_the_non_streamed_body(case):
    req = parse({"input": "2+3?", "tools": [CALC]})
    items: list[Any]
    if case == "text":
        final = result("Hello there")
        items = [TextDelta("Hel"), TextDelta("lo"), TextDelta(" there"), final]
    elif case == "reasoning_text_calls":
        final = result("Let me.", calls=(call("c1"), call("c2")), reasoning="hmm ok")
        items = [ReasoningDelta("hmm"), ReasoningDelta(" ok"), TextDelta("Let"), TextDelta(" me."),
                 final]
    elif case == "calls_only":
        final = result(None, calls=(call("c1"),))
        items = [final]
    elif case == "no_deltas":
        final = result("all at once", reasoning="r")
        items = [final]
    elif case == "length":
        final = result("cut sho", finish="length")
        items = [TextDelta("cut"), final]  # the tail arrives with the result
    else:
        final = result("answer", reasoning="late")
        items = [TextDelta("answer"), ReasoningDelta("late"), final]
    events = stream(req, items)
    _check_consistent(events)
    body = dict(_final(events))
    Response.model_validate(body)
    expected = DIALECT.render(final, req, {})
    if case == "reasoning_after_text":  # streamed in the order it arrived
        assert [o["type"] for o in body["output"]] == ["message", "reasoning"]
        body["output"] = body["output"][::-1]
    assert body == expected


def _check_consistent(events: list[dict[str, Any]]) -> None:
    """Deltas add up to each done text; every added item is done at the index it was added at, with
    the item the final response holds there."""
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    first = events[0]["response"]
    assert first["status"] == "in_progress" and first["output"] == []
    final = events[-1]["response"]["output"]
    texts: dict[tuple[str, str], str] = {}
    added: dict[int, dict[str, Any]] = {}
    for e in events:
        kind = e["type"]
        if kind.endswith(".delta"):
            key = (kind.removesuffix(".delta"), e["item_id"])
            texts[key] = texts.get(key, "") + e["delta"]
        elif kind.endswith("_text.done"):
            assert texts.get((kind.removesuffix(".done"), e["item_id"]), "") == e["text"]
        elif kind == "response.function_call_arguments.done":
            assert texts[("response.function_call_arguments", e["item_id"])] == e["arguments"]
        elif kind == "response.output_item.added":
            assert e["output_index"] not in added
            added[e["output_index"]] = e["item"]
        elif kind == "response.output_item.done":
            assert added[e["output_index"]]["id"] == e["item"]["id"]
            assert final[e["output_index"]] == e["item"]
    assert sorted(added) == list(range(len(final)))


def test_streamed_length_ends_with_response_incomplete():
    req = parse({"input": "x"})
    events = stream(req, [TextDelta("a"), result("a", finish="length")])
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_error_mid_stream_is_an_error_event_then_response_failed():
    req = parse({"input": "x"})
    events = stream(req, [TextDelta("a"), GatewayHTTPError(503, "no engine", type_="server_error",
                                                           code="engine_unavailable")])
    error, failed = events[-2], events[-1]
    assert error["type"] == "error" and error["code"] == "engine_unavailable"
    assert error["message"] == "no engine"
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": "no engine"}
    Response.model_validate(failed["response"])
    assert stream(parse({"input": "x"}), [])[-1]["type"] == "response.failed"


def test_a_streamed_response_is_stored_like_a_non_streamed_one():
    state: dict[str, Any] = {}
    req = parse({"input": "q"}, state)
    stream(req, [TextDelta("A"), result("A")], state)
    msgs = parse({"input": "z", "previous_response_id": req.extra["response_id"]}, state).messages
    assert msgs == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A"},
                    {"role": "user", "content": "z"}]


# ---- real clients over an in-memory transport ---------------------------------------------------
class Dialogue:
    """The dialect behind an HTTP handler, with a scripted policy: a calculator call for a question,
    the answer after the tool output.  Records every parsed request."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}
        self.requests: list[TurnRequest] = []
        self.results: list[TurnResult] = []

    def policy(self, req: TurnRequest) -> TurnResult:
        last = req.messages[-1]
        if last["role"] == "tool":
            return result(f"The answer is {last['content']}.", reasoning="the tool said so")
        n = len(self.results)
        return result(None, calls=(call(f"call_{n}"),), reasoning="I should use the calculator")

    def items(self, req: TurnRequest, res: TurnResult) -> list[TurnEvent]:
        out: list[TurnEvent] = []
        if res.message.get("reasoning_content"):
            out.append(ReasoningDelta(res.message["reasoning_content"]))
        text = res.message.get("content") or ""
        out.extend(TextDelta(text[i:i + 4]) for i in range(0, len(text), 4))
        return [*out, res]

    def respond(self, body: Any) -> tuple[int, bytes, str]:
        try:
            req = DIALECT.parse(body, self.state)
        except GatewayHTTPError as e:
            return e.status, json.dumps(DIALECT.error_body(e)).encode(), "application/json"
        res = self.policy(req)
        self.requests.append(req)
        self.results.append(res)
        if not req.stream:
            body = DIALECT.render(res, req, self.state)
            return 200, json.dumps(body).encode(), "application/json"

        async def collect() -> str:
            gen = DIALECT.render_stream(_events(self.items(req, res)), req, self.state)
            return "".join([line async for line in gen])

        return 200, asyncio.run(collect()).encode(), "text/event-stream"

    def sync_handler(self, request: httpx.Request) -> httpx.Response:
        status, content, media = self.respond(json.loads(request.content))
        return httpx.Response(status, content=content, headers={"content-type": media})

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url="http://gw/sessions/s/v1", api_key="k", max_retries=0,
                             http_client=httpx.Client(transport=httpx.MockTransport(self.sync_handler)))


def _tool_loop(client: openai.OpenAI, create: Callable[..., Any], stateful: bool) -> str:
    items: list[Any] = [{"role": "user", "content": "What is 2+3?"}]
    kwargs: dict[str, Any] = {"model": "m", "instructions": "Use the calculator.", "tools": [CALC]}
    response = create(input=items, store=stateful, **kwargs)
    calls = [o for o in response.output if o.type == "function_call"]
    assert len(calls) == 1 and json.loads(calls[0].arguments) == {"expression": "2+3"}
    output = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"}
    if stateful:
        response = create(input=[output], previous_response_id=response.id, **kwargs)
    else:
        items += [o.model_dump(exclude_none=True) for o in response.output] + [output]
        response = create(input=items, store=False, **kwargs)
    return response.output_text


@pytest.mark.parametrize("mode", ["create", "create_stream", "stream_helper"])
@pytest.mark.parametrize("stateful", [True, False], ids=["previous_response_id", "store_false"])
def test_openai_sdk_tool_loop(mode, stateful):
    dialogue = Dialogue()
    client = dialogue.client()

    def create(**kwargs: Any) -> Any:
        if mode == "create":
            return client.responses.create(**kwargs)
        if mode == "create_stream":
            done = [e for e in client.responses.create(stream=True, **kwargs)
                    if e.type in ("response.completed", "response.incomplete")]
            assert len(done) == 1
            return done[0].response
        with client.responses.stream(**kwargs) as events:
            for _ in events:
                pass
            return events.get_final_response()

    assert _tool_loop(client, create, stateful) == "The answer is 5."
    first, second = dialogue.requests
    assert all(r.stream == (mode != "create") for r in dialogue.requests)
    # the second request continues the first exactly: what the trie needs to extend the branch
    assert canon(second.messages[:len(first.messages)]) == canon(first.messages)
    assert canon([second.messages[len(first.messages)]]) == canon([dialogue.results[0].message])
    echoed = second.messages[len(first.messages)]
    assert echoed["reasoning_content"] == "I should use the calculator"
    assert second.messages[-1] == {"role": "tool", "content": "5", "tool_call_id": "call_0"}


def test_openai_sdk_sees_400s_in_openai_shape():
    client = Dialogue().client()
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", input="x", previous_response_id="resp_missing")
    assert info.value.code == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", input="x", tools=[{"type": "web_search"}])
    assert info.value.param == "tools.0.type"


def test_openai_agents_runner_with_its_default_responses_model():
    agents = pytest.importorskip("agents")
    dialogue = Dialogue()

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        status, content, media = await asyncio.to_thread(dialogue.respond, body)
        return httpx.Response(status, content=content, headers={"content-type": media})

    @agents.function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return str(eval(expression, {"__builtins__": {}}))  # the test's own fixed expressions

    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url="http://gw/sessions/s/v1", api_key="k", max_retries=0,
                                    http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
        model = agents.OpenAIResponsesModel(model="m", openai_client=client)
        agent = agents.Agent(name="calc", instructions="Use the calculator.", tools=[calculator],
                             model=model)
        return await agents.Runner.run(agent, "What is 2+3?")

    agents.set_tracing_disabled(True)
    out = asyncio.run(run())
    assert out.final_output == "The answer is 5."
    first, second = dialogue.requests
    assert canon(second.messages[:len(first.messages)]) == canon(first.messages)
    assert canon([second.messages[len(first.messages)]]) == canon([dialogue.results[0].message])
    assert second.messages[-1]["role"] == "tool" and second.messages[-1]["content"] == "5"


# ---- the live gateway: real HTTP, fake engine, the tiny model's tokenizer ------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from agentloop.testing.tiny_model import ensure_tiny_model

    return AutoTokenizer.from_pretrained(str(ensure_tiny_model()))


@pytest.fixture
def gateway(tokenizer):
    gw = LiveGateway(tokenizer)
    yield gw
    gw.close()


def _sdk(handle: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=handle.base_url, api_key=handle.api_key, max_retries=0,
                         timeout=30)


def _chat_form(instructions: str, question: str, received: list[Any]) -> list[dict[str, Any]]:
    """The conversation the client saw, as chat messages (function calls as tool_calls)."""
    conv: list[dict[str, Any]] = [{"role": "system", "content": instructions},
                                  {"role": "user", "content": question}]
    for item in received:
        if item["type"] == "function_call":
            conv.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": json.loads(item["arguments"])}}]})
        elif item["type"] == "function_call_output":
            conv.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": item["output"]})
        else:
            conv.append({"role": "assistant", "content": item["content"][0]["text"]})
    return conv


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("stateful", [True, False], ids=["previous_response_id", "store_false"])
def test_live_gateway_tool_loop_records_a_token_exact_trajectory(gateway, tokenizer, stream,
                                                                 stateful):
    handle = gateway.session()
    client = _sdk(handle)

    def create(**kwargs: Any) -> Any:
        if not stream:
            return client.responses.create(**kwargs)
        with client.responses.stream(**kwargs) as events:
            return events.get_final_response()

    instructions, question = "You are a calculator.", "What is 6*7?"
    fn = CALC_TOOL["function"]
    kwargs: dict[str, Any] = {"model": "m", "instructions": instructions, "tools": [
        {"type": "function", "name": fn["name"], "description": fn["description"],
         "parameters": fn["parameters"]}]}
    items: list[Any] = [{"role": "user", "content": question}]
    first = create(input=items, store=stateful, **kwargs)
    [fc] = [o for o in first.output if o.type == "function_call"]
    assert fc.name == "calculator" and json.loads(fc.arguments) == {"expression": "6*7"}
    output = {"type": "function_call_output", "call_id": fc.call_id, "output": "42"}
    received = [o.model_dump(exclude_none=True) for o in first.output]
    if stateful:
        second = create(input=[output], previous_response_id=first.id, **kwargs)
    else:
        second = create(input=[*items, *received, output], store=False, **kwargs)
    assert second.output_text == "The answer is 42." and second.status == "completed"
    assert second.usage is not None and second.usage.output_tokens > 0
    received += [output, *(o.model_dump(exclude_none=True) for o in second.output)]
    [traj] = gateway.finalize(handle.session_id)["trajectories"]
    ids = list(traj.prompt_ids) + list(traj.response_ids)
    sep = tokenizer.encode("\n", add_special_tokens=False)
    assert ids + sep == full_render_ids(tokenizer, _chat_form(instructions, question, received),
                                        [CALC_TOOL])
    sampled = [t for t, m in zip(traj.response_ids, traj.response_mask, strict=True) if m == 1]
    assert tokenizer.decode(sampled).count("<|im_end|>") == 2


def test_live_gateway_refusals_are_openai_shaped_4xx_and_record_nothing(gateway):
    handle = gateway.session()
    url = f"{handle.base_url}/responses"
    headers = {"Authorization": f"Bearer {handle.api_key}"}
    for body in ({"input": [{"type": "bogus"}]}, {"input": "x", "tools": [{"type": "web_search"}]},
                 {"input": "x", "previous_response_id": "resp_x"},
                 {"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]},
                 {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
                 {"input": "x", "temperature": "warm"}):
        reply = httpx.post(url, json=body, headers=headers, timeout=30)
        assert reply.status_code == 400, (body, reply.text)
        assert set(reply.json()["error"]) >= {"message", "type", "param", "code"}
    reply = httpx.post(url, json={"input": "x"}, timeout=30)
    assert reply.status_code == 401 and reply.json()["error"]["message"]
    assert gateway.finalize(handle.session_id)["trajectories"] == []
