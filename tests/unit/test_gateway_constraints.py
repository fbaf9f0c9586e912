"""gateway.constraints: tool_choice / response_format -> the engine's structured-outputs entry.

Each grammar is compiled with xgrammar (vLLM's default backend) and checked against what the
served format's parser reads as a call: the text a grammar admits must parse, and text it must
refuse is refused.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from gateway_helpers import CALC_TOOL, FakePolicy, LiveGateway, client_for
from omegaconf import OmegaConf

from agentloop.batch.data import rows_to_batch
from agentloop.config import default_config
from agentloop.errors import ServerError
from agentloop.gateway.actor import GatewayActor
from agentloop.gateway.constraints import (
    MAX_WHITESPACE,
    STRUCTURED_OUTPUTS,
    apply,
    engine_entry,
    json_answer,
)
from agentloop.gateway.framework import register_agent_runner
from agentloop.gateway.protocol import GatewayHTTPError
from agentloop.gateway.turn import TurnRequest
from agentloop.loops.base import resolve_registry
from agentloop.parsers import (
    GlmToolParser,
    GptOssToolParser,
    HermesToolParser,
    KimiToolParser,
    Llama3JsonToolParser,
    MiniMaxToolParser,
    Qwen3CoderToolParser,
    SeedToolParser,
    ToolParser,
)
from agentloop.parsers.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from agentloop.rollout.worker import AgentLoopWorker
from agentloop.servers.sglang import structured_sampling
from agentloop.testing.scripted import ScriptedServer

xgr = pytest.importorskip("xgrammar")

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {
            "type": "object", "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        },
    },
}
TOOLS = [CALC, WEATHER]
SCHEMA = {
    "type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
    "additionalProperties": False,
}

# one call of calculator(expression="1+2") in each format a grammar is built for
CALLS: dict[type[ToolParser], str] = {
    HermesToolParser: (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>'
    ),
    Llama3JsonToolParser: '{"name": "calculator", "parameters": {"expression": "1+2"}}',
    Qwen3CoderToolParser: (
        "<tool_call>\n<function=calculator>\n<parameter=expression>\n1+2\n</parameter>\n"
        "</function>\n</tool_call>"
    ),
    SeedToolParser: (
        "<seed:tool_call>\n<function=calculator>\n<parameter=expression>\n1+2\n"
        "</parameter>\n</function>\n</seed:tool_call>"
    ),
    GlmToolParser: (
        "<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>1+2</arg_value>\n"
        "</tool_call>"
    ),
    MiniMaxToolParser: (
        '<minimax:tool_call>\n<invoke name="calculator">\n<parameter name="expression">'
        "1+2</parameter>\n</invoke>\n</minimax:tool_call>"
    ),
}
SEPARATORS = {Llama3JsonToolParser: "; "}


def accepts(entry: dict[str, Any], text: str) -> bool:
    """Whether the grammar of a structured-outputs entry admits ``text`` as a whole output."""
    from xgrammar.testing import _is_grammar_accept_string  # xgrammar's own acceptance check

    assert set(entry) == {"structural_tag"}
    grammar = xgr.Grammar.from_structural_tag(entry["structural_tag"])
    return _is_grammar_accept_string(grammar, text)


def request(
    tool_choice: Any = "auto", tools: list[dict[str, Any]] | None = None,
    response_format: dict[str, Any] | None = None,
) -> TurnRequest:
    return TurnRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=tools, sampling={},
        tool_choice=tool_choice, response_format=response_format,
    )


@pytest.mark.parametrize("tool_choice", ["auto", "none"])
def test_free_choices_leave_sampling_free(tool_choice):
    params: dict[str, Any] = {"temperature": 1.0}
    assert apply(request(tool_choice, TOOLS), HermesToolParser(None), params) is False
    assert params == {"temperature": 1.0}
    assert engine_entry(tool_choice, TOOLS, {"type": "text"}, HermesToolParser(None)) is None


@pytest.mark.parametrize("parser_class", list(CALLS))
def test_required_forces_a_call_the_parser_reads(parser_class):
    parser = parser_class(None)
    params: dict[str, Any] = {}
    assert apply(request("required", TOOLS), parser, params) is True
    entry = params[STRUCTURED_OUTPUTS]
    assert set(entry) == {"structural_tag"}
    call = CALLS[parser_class]
    assert accepts(entry, call)
    assert accepts(entry, call + SEPARATORS.get(parser_class, "\n") + call)  # parallel calls
    assert not accepts(entry, "")  # at least one call
    assert not accepts(entry, "The answer is 3.")
    assert not accepts(entry, "sure: " + call)  # nothing before the call
    content, calls = parser.parse_text(call, TOOLS)
    assert not content
    assert [(c.name, json.loads(c.arguments), c.error) for c in calls] == [
        ("calculator", {"expression": "1+2"}, None)
    ]


@pytest.mark.parametrize("parser_class", list(CALLS))
def test_a_named_function_forces_exactly_that_function(parser_class):
    entry = engine_entry(
        {"type": "function", "name": "calculator"}, TOOLS, None, parser_class(None)
    )
    call = CALLS[parser_class]
    assert accepts(entry, call)
    assert not accepts(entry, call + SEPARATORS.get(parser_class, "\n") + call)  # exactly one call
    weather = call.replace("calculator", "weather").replace("expression", "city")
    assert not accepts(entry, weather)
    assert accepts(
        engine_entry({"type": "function", "name": "weather"}, TOOLS, None, parser_class(None)),
        weather,
    )


def test_arguments_follow_the_tools_schema():
    entry = engine_entry("required", TOOLS, None, HermesToolParser(None))
    assert not accepts(entry, '<tool_call>\n{"name": "calculator", "arguments": {}}\n</tool_call>')
    assert not accepts(
        entry, '<tool_call>\n{"name": "calculator", "arguments": {"expression": 3}}\n</tool_call>'
    )
    assert not accepts(entry, '<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>')


def test_response_format_json_schema_and_json_object():
    schema_format = {
        "type": "json_schema",
        "json_schema": {"name": "a", "schema": SCHEMA, "strict": True},
    }
    entry = engine_entry("auto", None, schema_format, None)
    assert set(entry) == {"structural_tag"}
    assert accepts(entry, '{"answer": "yes"}')
    assert accepts(entry, '{\n  "answer": "yes"\n}')
    assert not accepts(entry, '{"answer": "maybe"}')
    assert not accepts(entry, "yes")
    assert not accepts(entry, '{"answer":' + " " * (MAX_WHITESPACE + 1) + '"yes"}')
    any_object = engine_entry("auto", None, {"type": "json_object"}, None)
    assert accepts(any_object, '{"x": [1, 2]}') and not accepts(any_object, "[1, 2]")
    # without a schema, json_schema means any JSON object
    no_schema = {"type": "json_schema", "json_schema": {"name": "a"}}
    assert engine_entry("auto", None, no_schema, None) == any_object
    assert json_answer({"type": "text"}) is None


def test_tool_choice_none_with_a_response_format_constrains_only_the_answer():
    entry = engine_entry("none", TOOLS, {"type": "json_object"}, HermesToolParser(None))
    assert entry == engine_entry("auto", None, {"type": "json_object"}, None)
    assert not accepts(entry, CALLS[HermesToolParser])


def test_auto_with_tools_and_a_response_format_is_a_call_or_a_json_answer():
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    entry = engine_entry("auto", TOOLS, fmt, HermesToolParser(None))
    assert accepts(entry, CALLS[HermesToolParser])
    assert accepts(entry, '{"answer": "no"}')
    assert not accepts(entry, "no")


def test_required_ignores_the_answers_response_format():
    fmt = {"type": "json_object"}
    assert engine_entry("required", TOOLS, fmt, HermesToolParser(None)) == engine_entry(
        "required", TOOLS, None, HermesToolParser(None)
    )


@pytest.mark.parametrize(
    "tool_choice, tools, parser, param, words",
    [
        ("required", None, HermesToolParser(None), "tools", "needs tools"),
        ("required", [], HermesToolParser(None), "tools", "needs tools"),
        (
            {"type": "function", "name": "nope"}, TOOLS, HermesToolParser(None), "tool_choice",
            "'nope'",
        ),
        ("required", TOOLS, None, "tool_choice", "multi_turn.format is not set"),
        ("required", TOOLS, KimiToolParser(None), "tool_choice", "KimiToolParser"),
        (
            {"type": "function", "name": "weather"}, TOOLS, GptOssToolParser(None), "tool_choice",
            "GptOssToolParser",
        ),
        ("any", TOOLS, HermesToolParser(None), "tool_choice", "not supported"),
        (
            {"type": "tool", "name": "weather"}, TOOLS, HermesToolParser(None), "tool_choice",
            "not supported",
        ),
    ],
)
def test_refusals_name_what_is_not_supported(tool_choice, tools, parser, param, words):
    with pytest.raises(GatewayHTTPError) as err:
        apply(request(tool_choice, tools), parser, {})
    assert err.value.status == 400
    assert err.value.param == param
    assert words in err.value.message


def test_a_format_without_a_grammar_names_the_formats_that_have_one():
    with pytest.raises(GatewayHTTPError) as err:
        engine_entry("required", TOOLS, None, KimiToolParser(None))
    assert "hermes" in err.value.message and "qwen3_coder" in err.value.message


@pytest.mark.parametrize(
    "response_format, param",
    [
        ({"type": "grammar"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        (
            {"type": "json_schema", "json_schema": {"schema": "x"}},
            "response_format.json_schema.schema",
        ),
        ("json", "response_format"),
    ],
)
def test_malformed_response_formats_are_refused(response_format, param):
    with pytest.raises(GatewayHTTPError) as err:
        apply(request("auto", None, response_format), None, {})
    assert (err.value.status, err.value.param) == (400, param)


def test_a_schema_the_grammar_backend_cannot_take_is_a_400_naming_its_part():
    bad = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": bad}}
    with pytest.raises(GatewayHTTPError) as err:
        engine_entry("auto", TOOLS, fmt, HermesToolParser(None))
    assert err.value.param == "response_format"
    assert 'cannot be made into a grammar: Unsupported type "nonsense"' in err.value.message
    tool = {"type": "function", "function": {"name": "f", "parameters": bad}}
    with pytest.raises(GatewayHTTPError) as err:
        engine_entry("required", [tool], None, HermesToolParser(None))
    assert err.value.param == "tools" and "the tools' parameters" in err.value.message


def test_a_subclass_of_a_parser_is_not_assumed_to_share_its_format():
    class Mine(HermesToolParser):
        pass

    with pytest.raises(GatewayHTTPError, match="Mine"):
        engine_entry("required", TOOLS, None, Mine(None))


def test_sglang_takes_the_same_entry_under_its_own_keys():
    entry = engine_entry("required", TOOLS, None, HermesToolParser(None))
    assert structured_sampling(entry) == {"structural_tag": entry["structural_tag"]}
    assert structured_sampling({"json": SCHEMA}) == {"json_schema": json.dumps(SCHEMA)}
    assert structured_sampling({"json_object": True}) == {"json_schema": '{"type": "object"}'}
    assert structured_sampling({"grammar": 'root ::= "a"', "json_object": None}) == {
        "ebnf": 'root ::= "a"'
    }
    with pytest.raises(ServerError, match="'choice' is not supported with rollout.name=sglang"):
        structured_sampling({"choice": ["a", "b"]})


def test_the_scripted_server_flags_a_grammar_it_does_not_follow():
    server = ScriptedServer([[5, 6, 2], [5, 6, 2]], eos_token_id=2)
    free = asyncio.run(server.generate([1], {"max_tokens": 8}, "a"))
    assert "structured_outputs_ignored" not in free.extra_fields
    entry = engine_entry("none", None, {"type": "json_object"}, None)
    out = asyncio.run(server.generate([1], {"max_tokens": 8, STRUCTURED_OUTPUTS: entry}, "b"))
    assert out.token_ids == [5, 6, 2] and out.extra_fields["structured_outputs_ignored"] is True
    assert server.calls[-1]["sampling_params"][STRUCTURED_OUTPUTS] == entry


# ---- through the gateway (chat dialect, the fake engine) --------------------------------------
@pytest.fixture
def gateway(tokenizer):
    gw = LiveGateway(tokenizer)
    yield gw
    gw.close()


def ask(client: Any, **kwargs: Any) -> Any:
    messages = [{"role": "user", "content": "What is 2+3?"}]
    return client.chat.completions.create(model="m", messages=messages, **kwargs)


def test_required_reaches_the_engine_and_flags_the_trajectory(gateway):
    handle = gateway.session()
    client = client_for(handle)
    free = ask(client, tools=[CALC_TOOL])
    forced = ask(client, tools=[CALC_TOOL], tool_choice="required")
    assert free.choices[0].finish_reason == forced.choices[0].finish_reason == "tool_calls"
    sent = [c["sampling_params"] for c in gateway.server.calls]
    assert STRUCTURED_OUTPUTS not in sent[0]
    parser = HermesToolParser(None)
    assert sent[1][STRUCTURED_OUTPUTS] == engine_entry("required", [CALC_TOOL], None, parser)
    trajectories = gateway.finalize(handle.session_id)["trajectories"]
    assert [t.constrained for t in trajectories] == [False, True]


def test_a_streamed_constrained_turn_is_flagged_as_the_plain_one(gateway):
    handle = gateway.session()
    chunks = list(ask(client_for(handle), tools=[CALC_TOOL], tool_choice="required", stream=True))
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [c.function.name for c in calls] == ["calculator"]
    assert STRUCTURED_OUTPUTS in gateway.server.calls[-1]["sampling_params"]
    (trajectory,) = gateway.finalize(handle.session_id)["trajectories"]
    assert trajectory.constrained is True


def test_a_named_function_in_chats_spelling(gateway):
    handle = gateway.session()
    choice = {"type": "function", "function": {"name": "calculator"}}
    ask(client_for(handle), tools=[CALC_TOOL], tool_choice=choice)
    entry = gateway.server.calls[-1]["sampling_params"][STRUCTURED_OUTPUTS]
    named = {"type": "function", "name": "calculator"}
    assert entry == engine_entry(named, [CALC_TOOL], None, HermesToolParser(None))


def test_a_json_schema_response_format_reaches_the_engine(gateway):
    handle = gateway.session()
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    ask(client_for(handle), response_format=fmt)
    entry = gateway.server.calls[-1]["sampling_params"][STRUCTURED_OUTPUTS]
    assert entry == engine_entry("auto", None, fmt, None)
    assert accepts(entry, '{"answer": "no"}')


@pytest.mark.parametrize("kwargs, param", [
    ({"tools": [CALC_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": 3}}},
     "response_format.json_schema.schema"),
])
def test_refused_requests_reach_no_engine_and_record_nothing(gateway, kwargs, param):
    handle = gateway.session()
    with pytest.raises(openai.BadRequestError) as err:
        ask(client_for(handle), **kwargs)
    assert err.value.status_code == 400 and err.value.body["param"] == param
    assert gateway.server.calls == []
    assert gateway.finalize(handle.session_id)["trajectories"] == []


def post(handle: Any, path: str, body: dict[str, Any]) -> Any:
    headers = {"Authorization": f"Bearer {handle.api_key}", "anthropic-version": "2023-06-01"}
    return httpx.post(f"{handle.base_url}/{path}", json=body, headers=headers, timeout=30)


def test_every_dialect_reaches_the_same_entry(gateway):
    """Messages' ``any`` / ``tool`` and Responses' ``tool_choice`` / ``text.format`` map onto the
    canonical request, so the engine gets the grammar chat's spelling gives."""
    handle = gateway.session()
    hello = [{"role": "user", "content": "What is 2+3?"}]
    anthropic_tool = {"name": "calculator", "input_schema": CALC_TOOL["function"]["parameters"]}
    responses_tool = {"type": "function", "name": "calculator",
                      "parameters": CALC_TOOL["function"]["parameters"]}
    bodies = [
        ("messages", {"model": "m", "max_tokens": 64, "messages": hello, "tools": [anthropic_tool],
                      "tool_choice": {"type": "any"}}),
        ("messages", {"model": "m", "max_tokens": 64, "messages": hello, "tools": [anthropic_tool],
                      "tool_choice": {"type": "tool", "name": "calculator"}}),
        ("responses", {"model": "m", "input": hello, "tools": [responses_tool],
                       "tool_choice": "required"}),
        ("responses", {"model": "m", "input": "Is it?", "text": {"format": {
            "type": "json_schema", "name": "verdict", "schema": SCHEMA}}}),
    ]
    for path, body in bodies:
        assert post(handle, path, body).status_code == 200
    sent = [c["sampling_params"][STRUCTURED_OUTPUTS] for c in gateway.server.calls]
    hermes = HermesToolParser(None)
    named = {"type": "function", "name": "calculator"}
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    assert sent == [
        engine_entry("required", [CALC_TOOL], None, hermes),
        engine_entry(named, [CALC_TOOL], None, hermes),
        engine_entry("required", [CALC_TOOL], None, hermes), engine_entry("auto", None, fmt, None),
    ]


def test_a_reasoning_model_thinks_first_then_follows_the_grammar():
    call = CALLS[HermesToolParser]
    opened = engine_entry("required", TOOLS, None, HermesToolParser(None),
                          DeepSeekR1ReasoningParser(None))
    assert accepts(opened, "the user wants 1+2</think>\n\n" + call)  # the prompt opened <think>
    assert not accepts(opened, call) and not accepts(opened, "thinking</think>\n\nThree.")
    own = engine_entry("required", TOOLS, None, HermesToolParser(None), Qwen3ReasoningParser(None))
    assert accepts(own, "<think>\nadd them\n</think>\n\n" + call) and accepts(own, call)
    answer = engine_entry("none", None, {"type": "json_object"}, None, Qwen3ReasoningParser(None))
    assert accepts(answer, '<think>\nok\n</think>\n{"a": 1}') and not accepts(answer, "<think>x")


# ---- the row an openai_agent sample gives --------------------------------------------------
async def chat_once(*, base_url: str, api_key: str, raw_prompt: list, **fields: Any) -> None:
    """One chat request with the sample's ``extra_info.request`` keys."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    request = fields["extra_info"]["request"]
    await client.chat.completions.create(model="m", messages=raw_prompt, **request)


def test_the_openai_agent_row_carries_the_constrained_flag(tokenizer):
    register_agent_runner("chat_once")(chat_once)
    cfg = default_config()
    cfg.data.max_prompt_length, cfg.data.max_response_length = 400, 200
    OmegaConf.resolve(cfg)
    OmegaConf.update(cfg, "actor_rollout_ref.rollout.multi_turn.format", "hermes")
    OmegaConf.update(cfg, "actor_rollout_ref.rollout.calculate_log_probs", True)
    rollout = cfg.actor_rollout_ref.rollout
    question = [{"role": "user", "content": "What is 2+3?"}]
    requests = [{"tools": [CALC_TOOL]}, {"tools": [CALC_TOOL], "tool_choice": "required"}]
    rows = [{"prompt": question, "agent_name": "chat_once",
             "extra_info": {"index": i, "request": r}} for i, r in enumerate(requests)]
    data = rows_to_batch(rows)

    async def run() -> Any:
        server = ScriptedServer(FakePolicy(tokenizer), eos_token_id=tokenizer.eos_token_id)
        model = OmegaConf.create({"path": "tiny"})
        gw = GatewayActor.from_slices(rollout, model, [server], tokenizer=tokenizer)
        await gw.start()
        try:
            worker = AgentLoopWorker.from_slices(rollout, model, [server],
                                                 registry=resolve_registry(), tokenizer=tokenizer,
                                                 gateways=[gw])
            return await worker.generate_sequences(data)
        finally:
            await gw.shutdown()

    out = asyncio.run(run())
    assert out.non_tensor_batch["status"].tolist() == ["stop", "stop"]
    assert out.non_tensor_batch["constrained"].tolist() == [False, True]
