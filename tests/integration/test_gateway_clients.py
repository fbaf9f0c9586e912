"""Real agent harnesses through the gateway's dialects on a real engine (vLLM CPU, tiny model).

Each client library talks to its own session exactly as it would talk to its provider (only the base
URL and key set); the tests check that the recorded trajectory is token for token what the client
received.  One manager (1 vLLM server, 1 worker) is shared by the module; a test's agent is an
in-process runner registered (with :func:`runner`) only while the module's manager lives; it runs
in the worker's process, so it hands what its client received back through a JSON file whose path
the test puts in ``extra_info`` (see :func:`run_agents`).
"""

from __future__ import annotations

import json
import os
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
def manager():
    import ray
    import ray.cloudpickle

    from agentloop.gateway.framework import register_agent_runner
    from agentloop.loops.base import _agent_loop_registry
    from agentloop.rollout.manager import AgentLoopManager
    from agentloop.testing.tiny_model import ensure_tiny_model

    for name, fn in RUNNERS.items():
        register_agent_runner(name)(fn)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=3, include_dashboard=False, logging_level="ERROR")
    cfg = default_config()
    for k, v in {
        "actor_rollout_ref.model.path": str(ensure_tiny_model()),
        "data.max_prompt_length": PROMPT_LEN,
        "data.max_response_length": RESPONSE_LEN,
        "actor_rollout_ref.rollout.dtype": "float32",
        "actor_rollout_ref.rollout.calculate_log_probs": True,
        "actor_rollout_ref.rollout.free_cache_engine": False,
        "actor_rollout_ref.rollout.max_num_seqs": 32,
        "actor_rollout_ref.rollout.agent.num_workers": 1,
        "actor_rollout_ref.rollout.server.num_servers": 1,
        "actor_rollout_ref.rollout.server.device": "cpu",
        "actor_rollout_ref.rollout.multi_turn.format": "hermes",
    }.items():
        OmegaConf.update(cfg, k, v)
    m = AgentLoopManager(cfg)
    yield m
    m.shutdown()
    ray.shutdown()
    for name in RUNNERS:
        _agent_loop_registry.pop(name, None)


def run_agents(
    manager: Any,
    agent_name: str,
    prompts: list[list[dict[str, Any]]],
    *,
    greedy: bool = True,
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
    """A langchain-openai tool loop on the calculator (``bind_tools``, greedy); every AI turn as the client
    received it (content, tool calls with parsed args) goes to ``report``."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # optional (dev extra)
    from langchain_openai import ChatOpenAI  # optional (dev extra)

    llm = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, temperature=0, max_retries=0)
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
            messages.append(ToolMessage(content=str(evaluate(call["args"]["expression"])), tool_call_id=call["id"]))
    Path(extra_info["report"]).write_text(json.dumps(turns))


def hermes_turn(run: str) -> dict[str, Any]:
    """A sampled assistant run (hermes format, ending with ``<|im_end|>``) as content and calls."""
    assert run.endswith("<|im_end|>"), run
    text = run.removesuffix("<|im_end|>")
    calls = [json.loads(c) for c in re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.S)]
    return {"content": text.split("<tool_call>")[0].strip(),
            "calls": [{"name": c["name"], "args": c["arguments"]} for c in calls]}


def test_langchain_openai_tool_loop_records_what_the_client_received(manager, tmp_path):
    """langchain-openai (``ChatOpenAI`` + ``bind_tools``) runs a calculator loop through a session unchanged;
    the trajectory's sampled runs are exactly the turns the client received, token for token."""
    rng = random.Random(11)
    prompts = [[{"role": "system", "content": SYSTEM_PROMPTS[1]}, {"role": "user", "content": word_problem(rng)[0]}]
               for _ in range(2)]
    reports = [tmp_path / f"langchain-{i}.json" for i in range(len(prompts))]
    rows = [{"prompt": p, "agent_name": "langchain_calculator",
             "extra_info": {"index": i, "report": str(reports[i])}} for i, p in enumerate(prompts)]
    batch = rows_to_batch(rows)
    batch.meta_info["validate"] = True  # greedy
    out = manager.generate_sequences(batch)
    nt = out.non_tensor_batch
    assert nt["status"].tolist() == ["stop", "stop"], nt.get("error")  # one trajectory per agent: no branching
    for row, index in enumerate(nt["index"].tolist()):
        turns = json.loads(reports[int(index)].read_text())
        assert any(turn["calls"] for turn in turns)  # the trained model calls the calculator
        runs = sampled_text(manager, out, row)  # the sampled ids of each assistant turn, decoded
        assert [hermes_turn(run) for run in runs] == turns
        assert "<tool_response>" not in "".join(runs)


# ---- OpenAI Responses API: openai SDK responses.create and openai-agents (Responses helper) -----


# ---- Anthropic Messages API: the anthropic SDK (Messages helper) --------------------------------


# ---- reasoning (reasoning helper) ---------------------------------------------------------------
# The reasoning model needs its own template and gateway.reasoning_parser, so it has its own module
# with one vLLM server: tests/integration/test_gateway_reasoning.py.


# ---- tool_choice and structured output (structured-output helper) -------------------------------


# ---- images (images helper) ---------------------------------------------------------------------
