"""The OpenAI Responses API dialect, request side and reply body (agentloop/gateway/dialects/
responses*.py), without an engine: every input item kind, tools, tool_choice, text.format, refusals
and hostile input (400 naming the place), the rendered ``response`` (checked with the openai SDK's
own ``Response`` model) and ``previous_response_id`` chains (stored, branched and ``store: false``).
Streaming and real clients: test_gateway_responses_stream.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.responses import Response
from responses_helpers import CALC, call, canon, parse, refused, result, stream

from agentloop.gateway.dialects.responses import DIALECT
from agentloop.gateway.protocol import GatewayHTTPError
from agentloop.gateway.turn import TextDelta


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


def test_input_image_becomes_a_chat_image_part():
    url = "data:image/png;base64,iVBORw0KGgo="
    req = parse({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"},
        {"type": "input_image", "image_url": url, "detail": "auto"}]}]})
    assert req.messages[0]["content"] == [{"type": "text", "text": "what is this?"},
                                          {"type": "image_url", "image_url": {"url": url}}]


def test_an_image_url_the_chat_path_refuses_is_a_400_naming_the_input_item():
    error = refused({"input": [
        {"role": "user", "content": "hi"},
        {"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]})
    assert error.param == "input.1.content.0" and error.message.startswith("input[1].content[0]")


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
    ({"input": "x", "background": True}, "background"), ({"input": "x", "n": 2}, "n"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({}, "input"), ({"input": []}, "input"), ({"input": ""}, "input"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]}, "input"),
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
