"""Real agent harnesses through the gateway's dialects on a real engine (vLLM CPU, tiny model).

Each client library talks to its own session exactly as it would talk to its provider (only the base
URL and key set); the tests check that the recorded trajectory is token for token what the client
received.  One manager (1 vLLM server, 1 worker) is shared by the module; a test's agent is an
in-process runner registered (with :func:`runner`) only while the module's manager lives; it runs
in the worker's process, so it hands what its client received back through a JSON file whose path
the test puts in ``extra_info`` (see :func:`run_agents`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import pytest
from omegaconf import OmegaConf

from agentloop.batch.data import rows_to_batch
from agentloop.config import default_config

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


# ---- OpenAI Responses API: openai SDK responses.create and openai-agents (Responses helper) -----


# ---- Anthropic Messages API: the anthropic SDK (Messages helper) --------------------------------


# ---- reasoning (reasoning helper) ---------------------------------------------------------------


# ---- tool_choice and structured output (structured-output helper) -------------------------------


# ---- images (images helper) ---------------------------------------------------------------------
