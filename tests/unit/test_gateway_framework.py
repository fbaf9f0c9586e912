"""The ``openai_agent`` loop: OpenAI-SDK agents mixed with tool_agent samples in one batch (fake
engine)."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import numpy as np
import openai
import pytest
from gateway_helpers import FakePolicy, run_calculator_agent
from omegaconf import OmegaConf

from agentloop.batch.protocol import DataProto
from agentloop.config import default_config
from agentloop.gateway.actor import GatewayActor
from agentloop.gateway.framework import register_agent_runner
from agentloop.loops.base import ResolvedAgentLoop, resolve_registry
from agentloop.rollout.worker import AgentLoopWorker
from agentloop.testing import ScriptedServer


async def sdk_calc(*, base_url: str, api_key: str, raw_prompt: list, **fields: Any) -> dict:
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    question = raw_prompt[-1]["content"]
    messages = await asyncio.to_thread(run_calculator_agent, client, question)
    truth = fields["extra_info"]["answer"]
    return {"score": float(messages[-1]["content"] == f"The answer is {truth}.")}


async def sdk_two_branches(
    *, base_url: str, api_key: str, raw_prompt: list, **fields: Any
) -> float:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    msgs = [{"role": "user", "content": "pick a word"}]
    await asyncio.gather(
        *(client.chat.completions.create(model="m", messages=msgs) for _ in range(2))
    )
    return 0.5


async def sdk_broken(*, base_url: str, api_key: str, raw_prompt: list, **fields: Any) -> None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "a word"}]
    )
    raise RuntimeError("agent crashed after one call")


async def sdk_slow(*, base_url: str, api_key: str, raw_prompt: list, **fields: Any) -> None:
    await asyncio.sleep(30)


@pytest.fixture(scope="module", autouse=True)
def _registered_runners():
    """Register the runners above only while this module's tests run: they live in a test module
    that Ray workers cannot import, so they must not be in the global registry when other tests
    start workers."""
    from agentloop.loops.base import _agent_loop_registry

    runners = {"sdk_calc": sdk_calc, "sdk_two_branches": sdk_two_branches, "sdk_broken": sdk_broken,
               "sdk_slow": sdk_slow}
    for name, fn in runners.items():
        register_agent_runner(name)(fn)
    yield
    for name in runners:
        _agent_loop_registry.pop(name, None)


def rollout(**gateway: Any) -> Any:
    cfg = default_config()
    cfg.data.max_prompt_length = 400
    cfg.data.max_response_length = 200
    OmegaConf.resolve(cfg)
    r = cfg.actor_rollout_ref.rollout
    r.calculate_log_probs = True
    r.multi_turn.format = "hermes"
    for k, v in gateway.items():
        OmegaConf.update(r, f"gateway.{k}", v)
    return r


def batch(rows: list[tuple[str, str, int]]) -> DataProto:
    n = len(rows)
    prompts = np.empty(n, dtype=object)
    prompts[:] = [[{"role": "user", "content": q}] for _, q, _ in rows]
    extra = np.empty(n, dtype=object)
    extra[:] = [{"answer": a} for *_, a in rows]
    nt = {
        "raw_prompt": prompts, "agent_name": np.array([r[0] for r in rows], dtype=object),
        "uid": np.array([f"u{i}" for i in range(n)], dtype=object), "index": np.arange(n),
        "extra_info": extra,
    }
    return DataProto(batch=None, non_tensor_batch=nt, meta_info={})


async def run_batch(tokenizer: Any, data: DataProto, registry: dict[str, Any] | None = None,
                    **gateway: Any) -> DataProto:
    r = rollout(**gateway)
    server = ScriptedServer(FakePolicy(tokenizer), eos_token_id=tokenizer.eos_token_id)
    gw = GatewayActor.from_slices(
        r, OmegaConf.create({"path": "tiny"}), [server], tokenizer=tokenizer
    )
    await gw.start()
    try:
        worker = AgentLoopWorker.from_slices(
            r, OmegaConf.create({"path": "tiny"}), [server],
            registry=registry if registry is not None else resolve_registry(), tokenizer=tokenizer,
            gateways=[gw],
        )
        return await worker.generate_sequences(data)
    finally:
        await gw.shutdown()


def test_sdk_agents_and_failures_are_isolated_in_one_batch(tokenizer):
    data = batch(
        [
            ("sdk_calc", "What is 2+3?", 5), ("sdk_two_branches", "x", 0), ("sdk_broken", "x", 0),
            ("sdk_calc", "What is 4*4?", 16),
        ]
    )
    out = asyncio.run(run_batch(tokenizer, data))
    uids = out.non_tensor_batch["uid"].tolist()
    assert (
        uids.count("u0") == 1
        and uids.count("u1") == 2
        and uids.count("u2") == 1
        and uids.count("u3") == 1
    )
    status = dict(zip(uids, out.non_tensor_batch["status"].tolist(), strict=False))
    assert status["u0"] == "stop" and status["u3"] == "stop"
    assert status["u2"] == "error"
    errors = dict(zip(uids, out.non_tensor_batch["error"].tolist(), strict=False))
    assert "agent crashed" in errors["u2"]
    scores = out.batch["rm_scores"].sum(-1).tolist()
    assert scores[uids.index("u0")] == 1.0 and scores[uids.index("u3")] == 1.0
    # reward_to=all
    assert [s for u, s in zip(uids, scores, strict=True) if u == "u1"] == [0.5, 0.5]
    assert scores[uids.index("u2")] == 0.0  # the crashed agent earns nothing
    # the calculator trajectory: two sampled assistant turns, tool turn masked out
    row = uids.index("u0")
    mask = out.batch["response_mask"][row]
    responses = out.batch["responses"][row][mask.bool()].tolist()
    assert tokenizer.decode(responses).count("<|im_end|>") == 2
    assert "<tool_response>" in tokenizer.decode(out.batch["responses"][row].tolist())


def test_session_timeout_ends_an_agent_that_overruns_it(tokenizer):
    out = asyncio.run(run_batch(tokenizer, batch([("sdk_slow", "x", 0)]), session_timeout=0.5))
    assert out.non_tensor_batch["status"].tolist() == ["timeout"]
    assert "session_timeout=0.5" in out.non_tensor_batch["error"][0]


def test_session_timeout_marks_only_that_sample(tokenizer):
    """The slow agent's own session_timeout (its registry entry overrides rollout.gateway's) ends
    it; the other sample has no deadline, so how fast this box runs it cannot turn it into a
    timeout."""
    registry = resolve_registry()
    registry["sdk_slow"] = ResolvedAgentLoop("sdk_slow", registry["openai_agent"].cls,
                                             {"runner": sdk_slow, "session_timeout": 0.5})
    data = batch([("sdk_slow", "x", 0), ("sdk_calc", "What is 1+2?", 3)])
    out = asyncio.run(run_batch(tokenizer, data, registry))
    status = dict(
        zip(
            out.non_tensor_batch["uid"].tolist(), out.non_tensor_batch["status"].tolist(),
            strict=False,
        )
    )
    assert status == {"u0": "timeout", "u1": "stop"}


def test_subprocess_runner_gets_the_session_in_its_environment(tokenizer, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(
        "import json, os\nfrom openai import OpenAI\n"
        "msgs = json.loads(os.environ['AGENTLOOP_RAW_PROMPT'])\n"
        "OpenAI(max_retries=0).chat.completions.create(model='m', messages=msgs)\n"
    )
    from agentloop.loops.base import ResolvedAgentLoop

    registry = resolve_registry()
    registry["cli_agent"] = ResolvedAgentLoop("cli_agent", registry["openai_agent"].cls,
                                              {"command": [sys.executable, str(script)]})

    async def go() -> DataProto:
        r = rollout()
        server = ScriptedServer(FakePolicy(tokenizer), eos_token_id=tokenizer.eos_token_id)
        gw = GatewayActor.from_slices(
            r, OmegaConf.create({"path": "tiny"}), [server], tokenizer=tokenizer
        )
        await gw.start()
        try:
            worker = AgentLoopWorker.from_slices(
                r, OmegaConf.create({"path": "tiny"}), [server], registry=registry,
                tokenizer=tokenizer, gateways=[gw],
            )
            return await worker.generate_sequences(batch([("cli_agent", "say a word", 0)]))
        finally:
            await gw.shutdown()

    out = asyncio.run(go())
    assert out.non_tensor_batch["status"].tolist() == ["stop"]
    assert int(out.batch["response_mask"].sum()) > 0



def test_worker_sample_timeout_closes_the_session(tokenizer):
    async def go() -> tuple[DataProto, int]:
        r = rollout()
        r.agent.sample_timeout = 0.5
        server = ScriptedServer(FakePolicy(tokenizer), eos_token_id=tokenizer.eos_token_id)
        gw = GatewayActor.from_slices(
            r, OmegaConf.create({"path": "tiny"}), [server], tokenizer=tokenizer
        )
        await gw.start()
        try:
            worker = AgentLoopWorker.from_slices(
                r, OmegaConf.create({"path": "tiny"}), [server], registry=resolve_registry(),
                tokenizer=tokenizer, gateways=[gw],
            )
            out = await worker.generate_sequences(batch([("sdk_slow", "x", 0)]))
            # closed at once; the bound only stops a hang
            deadline = asyncio.get_running_loop().time() + 30
            while gw.service.sessions and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            return out, len(gw.service.sessions)
        finally:
            await gw.shutdown()

    out, open_sessions = asyncio.run(go())
    assert out.non_tensor_batch["status"].tolist() == ["timeout"]
    assert open_sessions == 0
