"""Worker-local routing through the real AgentLoopManager on local Ray, with ScriptedServer actors
(no engine): ``rollout.server.balancer: local`` starts no balancer actor, a trajectory's turns stay
on one server, each worker's sticky cache is grown to its share of the batch, and a server the
supervisor finds dead is avoided by every worker at once (no failover needed in the next batch).
docs/routing.md#worker-local-routing."""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import pytest
from omegaconf import OmegaConf

from agentloop.testing.kill import kill_and_wait

pytestmark = pytest.mark.integration

SERVERS, WORKERS, TURNS = 3, 2, 3


@pytest.fixture(scope="module")
def ray_session():
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


def make_manager(ray: Any) -> Any:
    import agentloop.testing.fleet  # noqa: F401 - registers fleet_agent (a multi-turn loop)
    from agentloop.cluster.placement import ServerGroup
    from agentloop.config import default_config
    from agentloop.rollout.manager import AgentLoopManager
    from agentloop.testing import ScriptedServer
    from agentloop.testing.tiny_model import ensure_tiny_model

    handles = [ray.remote(num_cpus=0)(ScriptedServer).options(max_concurrency=1000).remote(
        delay=0.01, name=f"s{i}") for i in range(SERVERS)]
    cfg = default_config()
    cfg.actor_rollout_ref.model.path = str(ensure_tiny_model())
    cfg.data.max_prompt_length, cfg.data.max_response_length = 32, TURNS * 6
    for key, value in {
        "agent.num_workers": WORKERS, "agent.default_agent_loop": "fleet_agent",
        "free_cache_engine": False, "server.balancer": "local", "server.max_cache_size": 4,
    }.items():
        OmegaConf.update(cfg.actor_rollout_ref.rollout, key, value)
    group = ServerGroup(handles=handles, placement_group=None, device="cpu", info=[])
    return AgentLoopManager(cfg, servers=group)


def fleet_batch(n: int) -> Any:
    from agentloop.batch.data import rows_to_batch

    return rows_to_batch([{"prompt": [{"role": "user", "content": f"q{i}"}], "turns": TURNS}
                          for i in range(n)])


def calls_by_request(ray: Any, handles: list[Any]) -> dict[str, set[int]]:
    """request id -> the servers its generate calls went to."""
    seen: dict[str, set[int]] = defaultdict(set)
    for index, handle in enumerate(handles):
        ids = ray.get(handle.__ray_call__.remote(lambda s: [c["request_id"] for c in s.calls]))
        for rid in ids:
            seen[rid].add(index)
    return seen


def test_worker_local_routing_through_the_manager(ray_session):
    ray = ray_session
    manager = make_manager(ray)
    try:
        assert manager.balancer is None and manager.local_routing
        handles = list(manager.server_handles)
        out = manager.generate_sequences(fleet_batch(20))
        assert out.non_tensor_batch["status"].tolist() == ["stop"] * 20
        seen = calls_by_request(ray, handles)
        assert len(seen) == 20 and all(len(servers) == 1 for servers in seen.values())
        assert {s for servers in seen.values() for s in servers} == set(range(SERVERS))
        # twice the batch over 2 workers: 20 bindings each (max_cache_size 4 is only a floor)
        workers = manager.agent_loop_workers
        assert ray.get([w.ensure_cache_capacity.remote(0) for w in workers]) == [20, 20]

        kill_and_wait(handles[1])  # ray.kill returns before the actor is gone
        assert manager.supervisor.check() == [1]  # taken out and pushed to every worker's router
        before = calls_by_request(ray, [handles[0], handles[2]])
        nxt = manager.generate_sequences(fleet_batch(12))
        assert nxt.non_tensor_batch["status"].tolist() == ["stop"] * 12
        timing = nxt.meta_info["timing"]
        assert timing["agent_loop/faults/server_failovers"] == 0  # nobody had to find out first
        assert timing["agent_loop/faults/servers_down"] == 1
        after = calls_by_request(ray, [handles[0], handles[2]])
        assert len(after) - len(before) == 12
    finally:
        manager.shutdown()
