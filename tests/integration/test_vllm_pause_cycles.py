"""Ten pause -> update_weights -> resume cycles during a greedy ``tool_agent`` batch on a real vLLM
CPU engine.

The calculator task with the tiny model (it calls the calculator tool, reads the result and
answers), one server, two workers, ``async_training.partial_rollout: true``.  The batch is rolled
out once uninterrupted, then again while the driver pauses the server (every in-flight request is
aborted), loads the same weights under a new version and resumes, ten times.  No sample may be lost
or cut short: every row ends as it did uninterrupted, token for token (greedy, same weights: the
router re-issues each cut generation with its tokens so far), the tool calls in flight finish
normally, and the trajectories report the weight versions they saw.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf

pytestmark = pytest.mark.integration

CYCLES = 10


@pytest.fixture(scope="module")
def manager() -> Any:
    import ray

    from agentloop.config import default_config
    from agentloop.rollout.manager import AgentLoopManager
    from agentloop.testing.tiny_model import ensure_tiny_model

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    cfg = default_config()
    for k, v in {
        "actor_rollout_ref.model.path": str(ensure_tiny_model()), "data.max_prompt_length": 256,
        "data.max_response_length": 160, "actor_rollout_ref.rollout.dtype": "float32",
        "actor_rollout_ref.rollout.do_sample": False,
        "actor_rollout_ref.rollout.calculate_log_probs": True,
        "actor_rollout_ref.rollout.free_cache_engine": False,
        "actor_rollout_ref.rollout.enforce_eager": True,
        "actor_rollout_ref.rollout.max_num_seqs": 32,
        "actor_rollout_ref.rollout.agent.num_workers": 2,
        "actor_rollout_ref.rollout.server.num_servers": 1,
        "actor_rollout_ref.rollout.server.device": "cpu",
        "actor_rollout_ref.rollout.multi_turn.tool_config_path": "examples/calculator_agent/tools.yaml",  # noqa: E501
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 3,
    }.items():
        OmegaConf.update(cfg, k, v)
    OmegaConf.update(cfg, "async_training.partial_rollout", True, force_add=True)
    m = AgentLoopManager(cfg)
    yield m
    m.shutdown()
    ray.shutdown()


def calculator_batch(n: int) -> Any:
    from agentloop.batch.data import rows_to_batch
    from agentloop.testing.tiny_model import word_problem_rows

    return rows_to_batch(
        word_problem_rows(n, agent_name="tool_agent", data_source="calculator", seed=3)
    )


@pytest.fixture(scope="module")
def reference(manager: Any) -> tuple[Any, Any, float, Any]:
    """The 24-row batch, its uninterrupted rows, the seconds they took (warm engine) and the
    model's weights."""
    from safetensors.torch import load_file

    from agentloop.testing.tiny_model import ensure_tiny_model

    batch = calculator_batch(24)
    # warm-up, so the timing below is of a warm engine
    manager.generate_sequences(calculator_batch(4))
    started = time.perf_counter()
    want = manager.generate_sequences(batch)
    return (
        batch, want, time.perf_counter() - started,
        load_file(str(ensure_tiny_model() / "model.safetensors")),
    )


def test_ten_pause_update_resume_cycles_during_a_tool_agent_batch_lose_nothing(
    manager: Any, reference: Any
) -> None:
    batch, want, uninterrupted, weights = reference
    result: dict[str, Any] = {}
    rollout = threading.Thread(target=lambda: result.update(out=manager.generate_sequences(batch)))
    rollout.start()
    cut, versions, stamps = [], [], []
    # a pause lands every ~1/40 of the batch
    while sum(1 for n in cut if n) < CYCLES and rollout.is_alive():
        time.sleep(uninterrupted / 40)
        t0 = time.perf_counter()
        cut.append(manager.pause())
        versions.append(manager.update_weights(weights))
        manager.resume()
        stamps.append(round(time.perf_counter() - t0, 2))
    rollout.join(600)
    print(f"\ncycle seconds {stamps}")
    got = result["out"]
    nt, wt = got.non_tensor_batch, want.non_tensor_batch
    print(f"\nuninterrupted {uninterrupted:.1f}s; requests cut per pause: {cut}; "
          f"versions {versions[0]}..{versions[-1]}")
    assert sum(1 for n in cut if n) >= CYCLES  # ten pauses really cut generations in flight
    assert len(got) == len(want) == 24
    assert nt["status"].tolist() == wt["status"].tolist()
    assert not ({"error", "timeout", "aborted"} & set(nt["status"].tolist()))
    # the model called the tool: a real multi-turn batch
    assert np.mean(wt["__num_turns__"].astype(float)) > 2
    for key in ("responses", "response_mask"):  # token for token, tool turns included
        assert got.batch[key].tolist() == want.batch[key].tolist(), key
    mask = got.batch["response_mask"].bool()
    gap = (
        (got.batch["rollout_log_probs"] - want.batch["rollout_log_probs"])[mask].abs().max().item()
    )
    print(f"max log-prob gap over {int(mask.sum())} sampled tokens: {gap:.2e}")
    assert gap < 1e-3
    low, high = nt["min_global_steps"].astype(int), nt["max_global_steps"].astype(int)
    assert high.max() > low.min()  # trajectories saw several weight versions
    assert (low <= high).all() and high.max() <= versions[-1]
    # per token: the version that sampled it on mask-1 tokens (non-decreasing along the row), -1
    # elsewhere
    per_token = got.batch["rollout_weight_versions"]
    assert (per_token[~mask] == -1).all() and (per_token[mask] >= 0).all()
    for row in range(len(got)):
        sampled = per_token[row][mask[row]].tolist()
        assert sampled == sorted(sampled) and (min(sampled), max(sampled)) == (low[row], high[row])
    assert int(got.batch["rollout_weight_versions"].max()) > 0


def updates_during_the_batch(manager: Any, reference: Any, mode: str) -> Any:
    """The batch again while ``manager.update_weights`` (same weights) runs eight times under
    ``mode``, alone; checks that at least four landed and that the rows equal the uninterrupted ones
    token for token.
    """
    batch, want, uninterrupted, weights = reference
    manager.set_weight_update(mode)
    try:
        result: dict[str, Any] = {}
        rollout = threading.Thread(
            target=lambda: result.update(out=manager.generate_sequences(batch))
        )
        rollout.start()
        versions = []
        while len(versions) < 8 and rollout.is_alive():
            time.sleep(uninterrupted / 12)
            versions.append(manager.update_weights(weights))
        rollout.join(600)
    finally:
        manager.set_weight_update("abort")
    got = result["out"]
    assert len(versions) >= 4
    assert got.non_tensor_batch["status"].tolist() == want.non_tensor_batch["status"].tolist()
    assert not ({"error", "timeout", "aborted"} & set(got.non_tensor_batch["status"].tolist()))
    for key in ("responses", "response_mask"):
        assert got.batch[key].tolist() == want.batch[key].tolist(), key
    print(
        f"\n{mode}: {len(versions)} updates; {spanning_generations(got)} generations ran across one"
    )
    return got


def test_default_abort_updates_during_a_batch_resume_every_cut_generation(
    manager: Any, reference: Any
) -> None:
    """``server.weight_update: abort`` (the default): ``update_weights`` alone, eight times while
    the batch runs, cuts the generations in flight and they go on after it (verl's fully-async
    parameter sync); the rows equal the uninterrupted ones token for token and some generations ran
    across an update."""
    assert manager.rollout.server.weight_update == "abort"
    got = updates_during_the_batch(manager, reference, "abort")
    assert spanning_generations(got) >= 1


def spanning_generations(got: Any) -> int:
    """Generations (runs of mask-1 tokens) whose tokens carry more than one weight version."""
    mask = got.batch["response_mask"].bool()
    per_token = got.batch["rollout_weight_versions"]
    spanning = 0
    for row in range(len(got)):
        sampled = per_token[row][mask[row]].tolist()
        assert sampled == sorted(sampled)
        m = mask[row].tolist()
        turns: list[list[int]] = []  # the versions of each generation (a run of mask-1 tokens)
        for i, on in enumerate(m):
            if on and (i == 0 or not m[i - 1]):
                turns.append([])
            if on:
                turns[-1].append(int(per_token[row][i]))
        spanning += sum(1 for t in turns if len(set(t)) > 1)
    return spanning


def test_keep_mode_updates_during_a_batch_change_nothing_but_the_token_versions(
    manager: Any, reference: Any
) -> None:
    """``server.weight_update: keep``: eight updates (same weights) land while the batch runs,
    without a pause; the rows equal the uninterrupted ones token for token and a generation running
    across an update has its tokens tagged with both versions."""
    got = updates_during_the_batch(manager, reference, "keep")
    # an update landed mid-generation, which went on (not drained, not cut)
    assert spanning_generations(got) >= 1
