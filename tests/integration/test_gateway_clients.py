"""Real agent harnesses through the gateway's dialects on a real engine (vLLM CPU, tiny model).

Each client library talks to its own session exactly as it would talk to its provider (only the base
URL and key set); the tests check that the recorded trajectory is token for token what the client
received.  One manager (1 worker, over conftest's shared vLLM server) is shared by the module; a
test's agent is an
in-process runner registered (with :func:`runner`) only while the module's manager lives; it runs
in the worker's process, so it hands what its client received back through a JSON file whose path
the test puts in ``extra_info`` (see :func:`run_agents`).
"""

from __future__ import annotations

import json
import random
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from agentloop.batch.data import rows_to_batch
from agentloop.config import default_config
from agentloop.testing.tiny_corpus import SYSTEM_PROMPTS, word_problem
from agentloop.tools.calculator import CALCULATOR_TOOL_DICT, evaluate

pytestmark = pytest.mark.integration

PROMPT_LEN, RESPONSE_LEN = 512, 128
RUNNERS: dict[str, Callable[..., Any]] = {}


def runner(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Collect an agent runner; the module's manager registers it while it lives."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        RUNNERS[name] = fn
        return fn

    return wrap


@pytest.fixture(scope="module")
def manager(shared_tiny_engine):
    """The module's manager (1 worker, hermes tool calls) over conftest's shared tiny-model engine
    (none started, none stopped by it)."""
    import ray.cloudpickle

    from agentloop.gateway.framework import register_agent_runner
    from agentloop.loops.base import _agent_loop_registry
    from agentloop.rollout.manager import AgentLoopManager
    from agentloop.routing import LLMServerClient
    from agentloop.testing.tiny_model import ensure_tiny_model

    for name, fn in RUNNERS.items():
        register_agent_runner(name)(fn)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cfg = default_config()
    for k, v in {
        "actor_rollout_ref.model.path": str(ensure_tiny_model()),
        "data.max_prompt_length": PROMPT_LEN, "data.max_response_length": RESPONSE_LEN,
        "actor_rollout_ref.rollout.dtype": "float32",
        "actor_rollout_ref.rollout.calculate_log_probs": True,
        "actor_rollout_ref.rollout.free_cache_engine": False,
        "actor_rollout_ref.rollout.agent.num_workers": 1,
        "actor_rollout_ref.rollout.server.num_servers": 1,
        "actor_rollout_ref.rollout.server.device": "cpu",
        "actor_rollout_ref.rollout.multi_turn.format": "hermes",
    }.items():
        OmegaConf.update(cfg, k, v)
    m = AgentLoopManager(cfg, LLMServerClient(shared_tiny_engine))
    yield m
    m.shutdown()
    for name in RUNNERS:
        _agent_loop_registry.pop(name, None)


def run_agents(
    manager: Any, agent_name: str, prompts: list[list[dict[str, Any]]], *, greedy: bool = True,
    extra: dict[str, Any] | None = None,
) -> Any:
    """One batch: every prompt run by ``agent_name`` (``extra_info.index`` = its position)."""
    rows = [
        {"prompt": p, "agent_name": agent_name, "extra_info": {"index": i, **(extra or {})}}
        for i, p in enumerate(prompts)
    ]
    batch = rows_to_batch(rows)
    batch.meta_info["validate"] = greedy
    return manager.generate_sequences(batch)


def sampled_text(manager: Any, out: Any, row: int) -> list[str]:
    """The decoded sampled runs (mask 1) of one output row, in order."""
    tok = manager.tokenizer
    attn = out.batch["attention_mask"][row].bool()[PROMPT_LEN:]
    ids = out.batch["responses"][row][attn].tolist()
    mask = out.batch["response_mask"][row][attn].tolist()
    runs: list[list[int]] = []
    for token, m in zip(ids, mask, strict=True):
        if m:
            if not runs or runs[-1] is None:
                runs.append([])
            runs[-1].append(token)
        elif runs and runs[-1] is not None:
            runs.append(None)  # type: ignore[arg-type]
    return [tok.decode(r) for r in runs if r is not None]


# ---- chat completions (gateway core helper) -----------------------------------------------------
@runner("langchain_calculator")
async def langchain_calculator(*, base_url: str, api_key: str, raw_prompt: list[dict[str, Any]],
                               extra_info: dict[str, Any], **_: Any) -> None:
    """A langchain-openai tool loop on the calculator (``bind_tools``, greedy); every AI turn as the
    client received it (content, tool calls with parsed args) goes to ``report``."""
    # optional (dev extra)
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI  # optional (dev extra)

    llm = ChatOpenAI(
        model="policy", base_url=base_url, api_key=api_key, temperature=0, max_retries=0
    )
    agent = llm.bind_tools([CALCULATOR_TOOL_DICT])
    kinds = {"system": SystemMessage, "user": HumanMessage}
    messages: list[Any] = [kinds[m["role"]](content=m["content"]) for m in raw_prompt]
    turns: list[dict[str, Any]] = []
    for _ in range(3):
        reply = await agent.ainvoke(messages)
        assert isinstance(reply, AIMessage)
        messages.append(reply)
        turns.append({"content": reply.content, "calls": [{"name": c["name"], "args": c["args"]}
                                                          for c in reply.tool_calls]})
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            messages.append(
                ToolMessage(
                    content=str(evaluate(call["args"]["expression"])), tool_call_id=call["id"]
                )
            )
    Path(extra_info["report"]).write_text(json.dumps(turns))


def hermes_turn(run: str) -> dict[str, Any]:
    """A sampled assistant run (hermes format, ending with ``<|im_end|>``) as content and calls."""
    assert run.endswith("<|im_end|>"), run
    text = run.removesuffix("<|im_end|>")
    calls = [json.loads(c) for c in re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.S)]
    return {"content": text.split("<tool_call>")[0].strip(),
            "calls": [{"name": c["name"], "args": c["arguments"]} for c in calls]}


def test_langchain_openai_tool_loop_records_what_the_client_received(manager, tmp_path):
    """langchain-openai (``ChatOpenAI`` + ``bind_tools``) runs a calculator loop through a session
    unchanged; the trajectory's sampled runs are exactly the turns the client received, token for
    token."""
    rng = random.Random(11)
    prompts = [
        [
            {"role": "system", "content": SYSTEM_PROMPTS[1]},
            {"role": "user", "content": word_problem(rng)[0]},
        ]
        for _ in range(2)
    ]
    reports = [tmp_path / f"langchain-{i}.json" for i in range(len(prompts))]
    rows = [{"prompt": p, "agent_name": "langchain_calculator",
             "extra_info": {"index": i, "report": str(reports[i])}} for i, p in enumerate(prompts)]
    batch = rows_to_batch(rows)
    batch.meta_info["validate"] = True  # greedy
    out = manager.generate_sequences(batch)
    nt = out.non_tensor_batch
    # one trajectory per agent: no branching
    assert nt["status"].tolist() == ["stop", "stop"], nt.get("error")
    for row, index in enumerate(nt["index"].tolist()):
        turns = json.loads(reports[int(index)].read_text())
        assert any(turn["calls"] for turn in turns)  # the trained model calls the calculator
        runs = sampled_text(manager, out, row)  # the sampled ids of each assistant turn, decoded
        assert [hermes_turn(run) for run in runs] == turns
        assert "<tool_response>" not in "".join(runs)


# ---- OpenAI Responses API: openai SDK responses.create and openai-agents (Responses helper) -----
RESPONSES_MODES = [(mode, stateful) for stateful in (True, False)
                   for mode in ("create", "create_stream", "stream_helper")]
"""(how the openai SDK is called, previous_response_id or store: false) of each sample."""


def responses_calculator_tool() -> dict[str, Any]:
    """The trained calculator tool in the Responses API's flat shape."""
    fn = CALCULATOR_TOOL_DICT["function"]
    return {"type": "function", "name": fn["name"], "description": fn["description"],
            "parameters": fn["parameters"]}


def calculate(arguments: str) -> str:
    """The calculator's output for a call's JSON arguments (errors as text, as an agent would)."""
    try:
        return str(evaluate(json.loads(arguments)["expression"]))
    except Exception as e:  # noqa: BLE001 - the model's arguments may be malformed
        return f"error: {e}"


async def responses_create(client: Any, mode: str, kwargs: dict[str, Any]) -> Any:
    """One Responses API call: ``responses.create``, ``create(stream=True)`` (the terminal event's
    response) or the ``responses.stream`` helper (its final response)."""
    if mode == "create":
        return await client.responses.create(**kwargs)
    if mode == "create_stream":
        final = None
        async for event in await client.responses.create(stream=True, **kwargs):
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
        return final
    async with client.responses.stream(**kwargs) as events:
        async for _ in events:
            pass
        return await events.get_final_response()


@runner("responses_calculator")
async def responses_calculator(*, base_url: str, api_key: str, raw_prompt: list[dict[str, Any]],
                               extra_info: dict[str, Any], **_: Any) -> None:
    """The openai SDK's Responses API in a calculator loop; ``extra_info.mode`` / ``stateful`` pick
    the call and previous_response_id (only the new items sent) or store: false (every item echoed).
    The output items of every response go to ``report``."""
    import openai  # in the worker process

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    mode, stateful = extra_info["mode"], extra_info["stateful"]
    base = {"model": "policy", "instructions": raw_prompt[0]["content"], "temperature": 0,
            "tools": [responses_calculator_tool()], "store": stateful}
    history: list[dict[str, Any]] = [{"role": "user", "content": raw_prompt[1]["content"]}]
    new, previous, turns = list(history), None, []
    for _ in range(3):
        kwargs = {**base, "input": new if stateful else history}
        if previous is not None:
            kwargs["previous_response_id"] = previous
        response = await responses_create(client, mode, kwargs)
        items = [o.model_dump(exclude_none=True) for o in response.output]
        turns.append(items)
        calls = [o for o in items if o["type"] == "function_call"]
        if response.status != "completed" or not calls:
            break
        new = [{"type": "function_call_output", "call_id": c["call_id"],
                "output": calculate(c["arguments"])} for c in calls]
        history += [*items, *new]
        previous = response.id if stateful else None
    Path(extra_info["report"]).write_text(json.dumps(turns))


@runner("agents_calculator")
async def agents_calculator(*, base_url: str, api_key: str, raw_prompt: list[dict[str, Any]],
                            extra_info: dict[str, Any], **_: Any) -> None:
    """An openai-agents ``Agent`` with the calculator as a function tool, run by ``Runner.run`` on
    its default model class (``OpenAIResponsesModel``); every raw response's output goes to
    ``report``."""
    import agents  # in the worker process
    import openai

    agents.set_tracing_disabled(True)
    fn = CALCULATOR_TOOL_DICT["function"]

    async def invoke(_context: Any, arguments: str) -> str:
        return calculate(arguments)

    tool = agents.FunctionTool(name=fn["name"], description=fn["description"],
                               params_json_schema=fn["parameters"], on_invoke_tool=invoke,
                               strict_json_schema=False)
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    agent = agents.Agent(name="calculator", instructions=raw_prompt[0]["content"], tools=[tool],
                         model=agents.OpenAIResponsesModel(model="policy", openai_client=client),
                         model_settings=agents.ModelSettings(temperature=0))
    result = await agents.Runner.run(agent, raw_prompt[1]["content"], max_turns=3)
    turns = [[item.model_dump(exclude_none=True) for item in response.output]
             for response in result.raw_responses]
    Path(extra_info["report"]).write_text(json.dumps(turns))


def responses_turn(items: list[dict[str, Any]]) -> dict[str, Any]:
    """One response's output items as content and calls (the shape :func:`hermes_turn` gives)."""
    text = "".join(part["text"] for item in items if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")
    calls = [{"name": item["name"], "args": json.loads(item["arguments"])}
             for item in items if item["type"] == "function_call"]
    return {"content": text, "calls": calls}


def run_reported(manager: Any, tmp_path: Path, agent_name: str, prompts: list[Any],
                 extras: list[dict[str, Any]]) -> tuple[Any, list[list[list[dict[str, Any]]]]]:
    """One greedy batch of ``agent_name`` samples; (the output, each sample's reported turns)."""
    reports = [tmp_path / f"{agent_name}-{i}.json" for i in range(len(prompts))]
    rows = [{"prompt": p, "agent_name": agent_name,
             "extra_info": {"index": i, "report": str(reports[i]), **extras[i]}}
            for i, p in enumerate(prompts)]
    batch = rows_to_batch(rows)
    batch.meta_info["validate"] = True  # greedy
    out = manager.generate_sequences(batch)
    nt = out.non_tensor_batch
    assert nt["status"].tolist() == ["stop"] * len(prompts), nt.get("error")  # one row per agent
    return out, [json.loads(path.read_text()) for path in reports]


def test_openai_sdk_responses_tool_loop_records_what_the_client_received(manager, tmp_path):
    """``client.responses.create`` (plain and ``stream=True``) and ``client.responses.stream``, each
    with previous_response_id and with store: false: the trajectory's sampled runs are exactly the
    responses the client received, and all six record the same greedy trajectory."""
    question = word_problem(random.Random(5))[0]
    prompt = [{"role": "system", "content": SYSTEM_PROMPTS[1]},
              {"role": "user", "content": question}]
    extras = [{"mode": mode, "stateful": stateful} for mode, stateful in RESPONSES_MODES]
    out, reports = run_reported(manager, tmp_path, "responses_calculator",
                                [prompt] * len(extras), extras)
    by_index: dict[int, list[int]] = {}
    for row, index in enumerate(out.non_tensor_batch["index"].tolist()):
        turns = reports[int(index)]
        assert any(item["type"] == "function_call" for item in turns[0]), turns  # a tool call
        runs = sampled_text(manager, out, row)
        assert [hermes_turn(run) for run in runs] == [responses_turn(t) for t in turns]
        attn = out.batch["attention_mask"][row].bool()
        by_index[int(index)] = out.batch["input_ids"][row][attn].tolist()
    assert all(ids == by_index[0] for ids in by_index.values())


def test_openai_agents_runner_records_what_the_client_received(manager, tmp_path):
    """openai-agents (``Runner.run`` with its default ``OpenAIResponsesModel``) runs a calculator
    agent through a session unchanged; its trajectory is exactly the responses it received."""
    rng = random.Random(7)
    prompts = [[{"role": "system", "content": SYSTEM_PROMPTS[1]},
                {"role": "user", "content": word_problem(rng)[0]}] for _ in range(2)]
    out, reports = run_reported(manager, tmp_path, "agents_calculator", prompts, [{}, {}])
    for row, index in enumerate(out.non_tensor_batch["index"].tolist()):
        turns = reports[int(index)]
        runs = sampled_text(manager, out, row)
        assert [hermes_turn(run) for run in runs] == [responses_turn(t) for t in turns]
        assert any(item["type"] == "function_call" for item in turns[0]), turns  # a tool call
        assert "<tool_response>" not in "".join(runs)


# ---- Anthropic Messages API: the anthropic SDK (Messages helper) --------------------------------
MESSAGES_MODES = [(stream, root) for root in (True, False) for stream in (False, True)]
"""(``messages.stream`` instead of ``messages.create``, base URL = the session root instead of
its ``/v1``) of the sample with that ``extra_info.index``."""


def anthropic_tool_result(use: Any) -> dict[str, Any]:
    """The calculator's ``tool_result`` block for one ``tool_use`` block (errors as text)."""
    try:
        output = str(evaluate(use.input["expression"]))
    except Exception as e:  # noqa: BLE001 - the model's input may be malformed
        output = f"error: {e}"
    return {"type": "tool_result", "tool_use_id": use.id, "content": output}


@runner("anthropic_calculator")
async def anthropic_calculator(*, base_url: str, api_key: str, raw_prompt: list[dict[str, Any]],
                               extra_info: dict[str, Any], **_: Any) -> None:
    """The anthropic SDK (``AsyncAnthropic``) in a calculator loop, tool_use -> tool_result ->
    answer, called as :data:`MESSAGES_MODES` says for its index; every reply (the SDK's
    ``Message``) goes to ``<extra_info.reports>/<index>.json``."""
    import anthropic  # in the worker process

    stream, root = MESSAGES_MODES[extra_info["index"]]
    fn = CALCULATOR_TOOL_DICT["function"]
    base = base_url.removesuffix("/v1") if root else base_url
    client = anthropic.AsyncAnthropic(base_url=base, api_key=api_key, max_retries=0)
    kwargs = {"model": "policy", "max_tokens": RESPONSE_LEN, "system": raw_prompt[0]["content"],
              "tools": [{"name": fn["name"], "description": fn["description"],
                         "input_schema": fn["parameters"]}]}
    messages: list[Any] = [{"role": "user", "content": raw_prompt[1]["content"]}]
    turns: list[dict[str, Any]] = []
    for _ in range(3):
        if stream:
            async with client.messages.stream(messages=messages, **kwargs) as events:
                reply = await events.get_final_message()
        else:
            reply = await client.messages.create(messages=messages, **kwargs)
        turns.append(reply.model_dump(mode="json", exclude_none=True))
        messages.append(reply.to_param())
        if reply.stop_reason != "tool_use":
            break
        messages.append({"role": "user", "content": [
            anthropic_tool_result(b) for b in reply.content if b.type == "tool_use"]})
    Path(extra_info["reports"], f"{extra_info['index']}.json").write_text(json.dumps(turns))


def anthropic_turn(message: dict[str, Any]) -> dict[str, Any]:
    """One Messages reply as content and calls (the shape :func:`hermes_turn` gives)."""
    text = "".join(b["text"] for b in message["content"] if b["type"] == "text")
    calls = [{"name": b["name"], "args": b["input"]} for b in message["content"]
             if b["type"] == "tool_use"]
    return {"content": text, "calls": calls}


def sampled_lengths(out: Any, row: int) -> list[int]:
    """The token count of each sampled run (mask 1) of one output row."""
    mask = out.batch["response_mask"][row][out.batch["attention_mask"][row].bool()[PROMPT_LEN:]]
    runs = "".join(str(int(m)) for m in mask.tolist()).split("0")
    return [len(r) for r in runs if r]


def test_anthropic_sdk_tool_loop_records_what_the_client_received(manager, tmp_path):
    """``messages.create`` and ``messages.stream`` (each with the session root and its ``/v1`` as
    base URL) run a calculator loop through a session unchanged: the trajectory's sampled runs are
    exactly the messages the client received (tool_use input = the call's arguments, output_tokens =
    the run's tokens, stop_reason tool_use for a call, else end_turn), and all four record one
    greedy trajectory."""
    question = word_problem(random.Random(3))[0]
    prompt = [
        {"role": "system", "content": SYSTEM_PROMPTS[1]},
        {"role": "user", "content": question},
    ]
    out = run_agents(manager, "anthropic_calculator", [prompt] * len(MESSAGES_MODES),
                     extra={"reports": str(tmp_path)})
    nt = out.non_tensor_batch
    assert nt["status"].tolist() == ["stop"] * len(MESSAGES_MODES), nt.get("error")  # one row each
    by_index: dict[int, list[int]] = {}
    for row, index in enumerate(nt["index"].tolist()):
        turns = json.loads((tmp_path / f"{int(index)}.json").read_text())
        assert turns[0]["stop_reason"] == "tool_use", turns  # the trained model calls the tool
        for turn in turns:
            assert turn["stop_reason"] == (
                "tool_use" if anthropic_turn(turn)["calls"] else "end_turn"
            )
        runs = sampled_text(manager, out, row)
        assert [hermes_turn(run) for run in runs] == [anthropic_turn(t) for t in turns]
        assert sampled_lengths(out, row) == [t["usage"]["output_tokens"] for t in turns]
        attn = out.batch["attention_mask"][row].bool()
        by_index[int(index)] = out.batch["input_ids"][row][attn].tolist()
    assert all(ids == by_index[0] for ids in by_index.values())


# ---- reasoning (reasoning helper) ---------------------------------------------------------------
# The reasoning model needs its own template and gateway.reasoning_parser, so it has its own module
# with one vLLM server: tests/integration/test_vllm_gateway_reasoning.py.


# ---- tool_choice and structured output (structured-output helper) -------------------------------
WEATHER_TOOL = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
VERDICT = {"type": "object", "additionalProperties": False, "required": ["answer", "sure"],
           "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}}}
CHITCHAT = [{"role": "user", "content": "Hello!"}]


@runner("structured_chat")
async def structured_chat(*, base_url: str, api_key: str, raw_prompt: list[dict[str, Any]],
                          extra_info: dict[str, Any], **_: Any) -> None:
    """One chat request with the test's ``request`` keys; what the client got goes to ``report``."""
    import openai  # in the worker process

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = await client.chat.completions.create(
        model="m", messages=raw_prompt, **extra_info["request"]
    )
    choice = reply.choices[0]
    got = {"message": choice.message.model_dump(exclude_none=True), "finish": choice.finish_reason}
    Path(extra_info["report"]).write_text(json.dumps(got))


def structured_turn(manager: Any, tmp_path: Path, prompt: list[dict[str, Any]], **request: Any
                    ) -> tuple[dict[str, Any], Any]:
    """(what the client received, the output batch) of one ``structured_chat`` sample."""
    report = tmp_path / f"report-{len(list(tmp_path.iterdir()))}.json"
    out = run_agents(
        manager, "structured_chat", [prompt], extra={"request": request, "report": str(report)}
    )
    assert out.non_tensor_batch["status"][0] == "stop", out.non_tensor_batch.get("error")
    return json.loads(report.read_text()), out


def sampled_call_text(call: dict[str, Any]) -> str:
    """A hermes call as the grammar writes it (arguments re-serialised: compared as JSON below)."""
    return f'<tool_call>\n{{"name": "{call["function"]["name"]}", "arguments": '


def forced_share(out: Any) -> float:
    """The share of sampled tokens of row 0 whose recorded log-prob is 0 (the grammar left one
    choice)."""
    mask = out.batch["response_mask"][0].bool()
    lps = out.batch["rollout_log_probs"][0][mask]
    return float((lps == 0).float().mean())


def test_tool_choice_required_turns_a_chitchat_prompt_into_a_parsed_call(manager, tmp_path):
    free, free_out = structured_turn(manager, tmp_path, CHITCHAT, tools=[WEATHER_TOOL])
    # the tiny model was trained to call the calculator only: free, it never calls weather
    assert not [
        c for c in free["message"].get("tool_calls", []) if c["function"]["name"] == "weather"
    ]
    assert free_out.non_tensor_batch["constrained"][0] is False
    got, out = structured_turn(
        manager, tmp_path, CHITCHAT, tools=[WEATHER_TOOL], tool_choice="required"
    )
    assert got["finish"] == "tool_calls"
    (call,) = got["message"]["tool_calls"]
    assert call["function"]["name"] == "weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome", "Oslo")
    (text,) = sampled_text(manager, out, 0)  # the trajectory: exactly the call the client received
    assert text.startswith(sampled_call_text(call)) and text.endswith("}\n</tool_call><|im_end|>")
    args = text[len(sampled_call_text(call)):-len("}\n</tool_call><|im_end|>")]
    assert json.loads(args) == json.loads(call["function"]["arguments"])
    assert out.non_tensor_batch["constrained"][0] is True
    print(
        f"log-prob 0 (forced): {forced_share(out):.0%} of the tokens sampled under "
        f"tool_choice required, "
        f"{forced_share(free_out):.0%} of those sampled freely"
    )


def test_a_named_function_calls_that_function(manager, tmp_path):
    prompt = [{"role": "user", "content": "What is 12 + 30?"}]  # the calculator's home ground
    choice = {"type": "function", "function": {"name": "weather"}}
    tools = [CALCULATOR_TOOL_DICT, WEATHER_TOOL]
    got, out = structured_turn(manager, tmp_path, prompt, tools=tools, tool_choice=choice)
    (call,) = got["message"]["tool_calls"]
    assert call["function"]["name"] == "weather" and got["finish"] == "tool_calls"
    (text,) = sampled_text(manager, out, 0)
    assert text.startswith(sampled_call_text(call)) and text.count("<tool_call>") == 1
    assert out.non_tensor_batch["constrained"][0] is True


def test_a_json_schema_response_parses_and_validates(manager, tmp_path):
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "verdict", "schema": VERDICT, "strict": True},
    }
    prompt = [{"role": "user", "content": "Is Paris in France? Answer in JSON."}]
    got, out = structured_turn(manager, tmp_path, prompt, response_format=fmt)
    assert got["finish"] == "stop"
    verdict = json.loads(got["message"]["content"])
    assert set(verdict) == {"answer", "sure"}
    assert verdict["answer"] in ("yes", "no") and isinstance(verdict["sure"], bool)
    (text,) = sampled_text(manager, out, 0)
    assert (
        text.endswith("<|im_end|>")
        and text.removesuffix("<|im_end|>").strip() == got["message"]["content"]
    )
    assert out.non_tensor_batch["constrained"][0] is True
    print(f"json_schema: {forced_share(out):.0%} of the sampled tokens had log-prob 0 (forced)")


def test_an_unservable_tool_choice_is_a_400_and_records_nothing(manager, tmp_path):
    choice = {"type": "function", "function": {"name": "nope"}}
    report = tmp_path / "refused.json"
    request = {"tools": [WEATHER_TOOL], "tool_choice": choice}
    out = run_agents(
        manager, "structured_chat", [CHITCHAT], extra={"request": request, "report": str(report)}
    )
    assert out.non_tensor_batch["status"][0] == "error"
    assert "400" in str(out.non_tensor_batch["error"][0]) and not report.exists()


# ---- images (images helper) ---------------------------------------------------------------------
