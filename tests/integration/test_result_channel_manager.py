"""The result channel through the real AgentLoopManager on local Ray with ScriptedServer actors (no
engine): with ``agent.result_channel: tcp`` every group's rows come on the workers' connections
(none through Ray's stream) and the batch is the one ``ray`` gives; a worker whose connection is
gone yields its rows through Ray instead, and the batch is still complete.
docs/faults.md#result-channel.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ray_session():
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


@pytest.fixture
def server(ray_session: Any) -> Any:
    """One server per test: a manager given a ServerGroup stops its servers at shutdown."""
    from agentloop.testing import ScriptedServer

    return ray_session.remote(num_cpus=0)(ScriptedServer).options(max_concurrency=1000).remote(
        lambda ids, params, request_id: [7] * (len(ids) % 5 + 1) + [2], eos_token_id=2, delay=0.01
    )


def make_manager(server: Any, channel: str) -> Any:
    from agentloop.cluster.placement import ServerGroup
    from agentloop.config import default_config
    from agentloop.rollout.manager import AgentLoopManager
    from agentloop.testing.tiny_model import ensure_tiny_model

    cfg = default_config()
    cfg.actor_rollout_ref.model.path = str(ensure_tiny_model())
    cfg.data.max_prompt_length, cfg.data.max_response_length = 64, 16
    for key, value in {"agent.num_workers": 2, "free_cache_engine": False,
                       "calculate_log_probs": True, "agent.result_channel": channel}.items():
        OmegaConf.update(cfg.actor_rollout_ref.rollout, key, value)
    group = ServerGroup(handles=[server], placement_group=None, device="cpu", info=[{}],
                        placement="standalone")
    return AgentLoopManager(cfg, servers=group)


def batch(n: int) -> Any:
    from agentloop.batch.data import rows_to_batch

    return rows_to_batch([{"prompt": [{"role": "user", "content": "x " * (i % 7) + f"q{i}"}],
                           "index": i} for i in range(n)])


def frames_sent(ray: Any, manager: Any) -> list[int]:
    return ray.get([w.__ray_call__.remote(lambda w: w.results.frames_sent if w.results else -1)
                    for w in manager.agent_loop_workers])


def test_rows_come_on_the_channel_and_make_the_batch_ray_makes(ray_session, server):
    ray = ray_session
    tcp, via_ray = make_manager(server, "tcp"), make_manager(server, "ray")
    try:
        assert tcp.workers.channel is not None and via_ray.workers.channel is None
        assert frames_sent(ray, tcp) == [0, 0]
        a, b = tcp.generate_sequences(batch(24)), via_ray.generate_sequences(batch(24))
        # 2 workers x 2 row ranges each, every one on a connection
        assert sum(frames_sent(ray, tcp)) == 4 and frames_sent(ray, via_ray) == [-1, -1]
        assert a.non_tensor_batch["index"].tolist() == list(range(24))  # the batch's order
        assert a.non_tensor_batch["status"].tolist() == ["stop"] * 24
        assert sorted(a.batch.keys()) == sorted(b.batch.keys())
        for key in ("prompts", "responses", "response_mask", "attention_mask", "rollout_log_probs"):
            assert np.array_equal(a.batch[key].numpy(), b.batch[key].numpy()), key
        assert set(a.non_tensor_batch) == set(b.non_tensor_batch)
        assert a.meta_info["timing"]["agent_loop/serial/after_last_sample"] > 0
    finally:
        tcp.shutdown()
        via_ray.shutdown()


def test_a_worker_whose_connection_is_gone_sends_its_rows_through_ray(ray_session, server):
    ray = ray_session
    manager = make_manager(server, "tcp")
    try:
        first, second = manager.agent_loop_workers
        ray.get(first.__ray_call__.remote(lambda w: w.results.close()))
        out = manager.generate_sequences(batch(16))
        assert out.non_tensor_batch["index"].tolist() == list(range(16))
        assert out.non_tensor_batch["status"].tolist() == ["stop"] * 16
        assert frames_sent(ray, manager) == [0, 2]  # the first worker's two ranges came via Ray
    finally:
        manager.shutdown()
