"""Worker-local routing (``rollout.server.balancer: local``, docs/routing.md#worker-local-routing)
on the scripted engine, without Ray: the config key, no balancer actor, each worker's sticky cache
sized to its share, a trajectory's turns on one server, a dead server avoided by every worker's
router once the supervisor pushes it, the priority policy kept."""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from typing import Any

import pytest
from omegaconf import OmegaConf

from agentloop.cluster.placement import ServerGroup
from agentloop.cluster.supervisor import ServerSupervisor
from agentloop.config import RouterConfig, default_config, resolve_config
from agentloop.errors import ConfigError
from agentloop.rollout.startup import shared_balancer, sticky_share, worker_sections
from agentloop.rollout.worker import AgentLoopWorker
from agentloop.routing import AsyncLLMServerManager, build_router
from agentloop.testing import FakeTokenizer, ScriptedServer
from agentloop.testing.tiny_model import ensure_tiny_model

_S = "actor_rollout_ref.rollout.server"


def config(**server: Any) -> Any:
    cfg = default_config()
    cfg.actor_rollout_ref.model.path = str(ensure_tiny_model())
    for key, value in server.items():
        OmegaConf.update(cfg, f"{_S}.{key}", value)
    return cfg


def servers(n: int, delay: float = 0.0) -> list[ScriptedServer]:
    return [ScriptedServer(lambda ids, p, rid: [1, 2], delay=delay, name=f"s{i}") for i in range(n)]


def workers(handles: list[ScriptedServer], n: int, **kwargs: Any) -> list[AgentLoopWorker]:
    """``n`` in-process workers over ``handles``, each with its own router (no balancer actor)."""
    rollout = config().actor_rollout_ref.rollout
    return [
        AgentLoopWorker.from_slices(
            rollout, OmegaConf.create({"path": "unused"}), handles, tokenizer=FakeTokenizer(),
            **kwargs,
        )
        for _ in range(n)
    ]


async def trajectory(router: AsyncLLMServerManager, turns: int = 4) -> tuple[str, set[int]]:
    """One multi-turn trajectory (one request id); returns its id and the servers that served it."""
    rid, used = uuid.uuid4().hex, set()
    for _ in range(turns):
        out = await router.generate(rid, prompt_ids=[1, 2, 3], sampling_params={})
        used.add(out.extra_fields["server_index"])
        await asyncio.sleep(0)
    return rid, used


def test_balancer_key_defaults_to_shared_and_takes_only_shared_or_local():
    assert resolve_config(config()).server.balancer == "shared"
    assert resolve_config(config(balancer="local")).server.balancer == "local"
    with pytest.raises(ConfigError, match=r"server.balancer must be 'shared' .* or 'local' .*"
                                          r"got 'sharded'"):
        resolve_config(config(balancer="sharded"))


def test_local_mode_starts_no_balancer_actor():
    assert shared_balancer(64, 10_000, "local") is None
    assert shared_balancer(1, 10_000, "shared") is None  # one server: nothing to balance, as before


def test_each_worker_router_keeps_its_share_of_the_sticky_cache():
    # the manager wants twice the batch in all; 8 workers keep an eighth each
    assert sticky_share(2 * 100_000, 8) == 25_000
    assert sticky_share(2 * 5, 8) == 2 and sticky_share(7, 0) == 7
    cfg = resolve_config(config(balancer="local", max_cache_size=1000))
    assert worker_sections(cfg, 25_000).router.max_cache_size == 25_000  # a joiner's router
    assert worker_sections(cfg, 10).router.max_cache_size == 1000  # max_cache_size stays a floor
    (worker,) = workers(servers(2), 1)
    assert worker.ensure_cache_capacity(25_000) == 25_000
    assert worker.ensure_cache_capacity(100) == 25_000  # never shrinks


def test_a_trajectory_stays_on_one_server_across_worker_local_routers():
    handles = servers(4, delay=0.002)
    routers = [w.server_manager for w in workers(handles, 3)]

    async def main() -> list[tuple[str, set[int]]]:
        return await asyncio.gather(
            *(trajectory(routers[i % len(routers)]) for i in range(36))
        )

    results = asyncio.run(main())
    assert all(len(used) == 1 for _, used in results)
    per_server: dict[int, int] = defaultdict(int)
    for _, used in results:
        per_server[next(iter(used))] += 1
    assert sorted(per_server) == [0, 1, 2, 3]  # each worker spreads its own trajectories
    for i, server in enumerate(handles):  # the index reported is the server that was called
        mine = {rid for rid, used in results if used == {i}}
        assert {c["request_id"] for c in server.calls} == mine


def test_a_dead_server_is_avoided_by_every_worker_once_the_supervisor_pushes_it():
    handles = servers(3)
    pool = workers(handles, 2)
    group = ServerGroup(list(handles), None, "cpu", [])
    supervisor = ServerSupervisor(
        group, None, lambda i, h: None, restart=False,
        tell_down=lambda i: [w.mark_server_down(i) for w in pool],
    )
    supervisor.lose(1, "failed a health check (test)")
    assert supervisor.down == {1}
    # a replacement worker joining now starts with the server out of routing
    pool += workers(handles, 1, down_servers=(1,))

    async def main() -> list[tuple[str, set[int]]]:
        return await asyncio.gather(
            *(trajectory(pool[i % 3].server_manager, turns=2) for i in range(30))
        )

    results = asyncio.run(main())
    assert not handles[1].calls  # no worker tried it (none had to fail over first)
    assert {s for _, used in results for s in used} == {0, 2}
    assert all(w.server_manager.num_failovers == 0 for w in pool)
    for w in pool:  # a restarted server put back reaches every router (replace_server)
        w.replace_server(1, handles[1])
    results = asyncio.run(main())
    assert handles[1].calls


def test_priority_policy_is_kept_by_a_worker_local_router():
    cfg = resolve_config(config(balancer="local", priority="context"))
    handles = servers(2)
    router = build_router(RouterConfig.from_root(cfg.root), handles, None)
    asyncio.run(router.generate("r0", prompt_ids=[1] * 600, sampling_params={}))
    (call,) = [c for s in handles for c in s.calls]
    assert call["sampling_params"]["priority"] == -2  # a 600-token context: ahead of short ones
