"""Two AsyncLLMServerManagers sharing one GlobalBalancer actor over ScriptedServer actors (local
Ray, no engine)."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
from omegaconf import OmegaConf

from agentloop.errors import ServerError
from agentloop.routing import AsyncLLMServerManager, create_global_balancer
from agentloop.testing import ScriptedServer
from agentloop.testing.kill import kill_and_wait
from agentloop.types import StopReason

pytestmark = pytest.mark.integration

NUM_SERVERS = 4


@pytest.fixture(scope="module")
def ray_session():
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


def server_actors(ray: Any, n: int, delay: float) -> list[Any]:
    actor_cls = ray.remote(num_cpus=0)(ScriptedServer)
    return [actor_cls.remote(delay=delay, name=f"s{i}") for i in range(n)]


def wait_idle(ray: Any, balancer: Any, timeout: float = 5.0) -> dict[str, list[int]]:
    """Releases are fire-and-forget; poll until every in-flight count is back to 0."""
    deadline = time.monotonic() + timeout
    while True:
        stats = ray.get(balancer.stats.remote())
        if not any(stats["in_flight"]) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def test_two_managers_share_load_and_release(ray_session):
    ray = ray_session
    servers = server_actors(ray, NUM_SERVERS, delay=0.3)
    balancer = create_global_balancer(NUM_SERVERS, seed=0)
    a, b = AsyncLLMServerManager(servers, balancer), AsyncLLMServerManager(servers, balancer)

    async def main():
        calls = [m.generate(f"{tag}{i}", prompt_ids=[1, 2, 3], sampling_params={"max_tokens": 2})
                 for m, tag in ((a, "a"), (b, "b")) for i in range(4)]
        return await asyncio.gather(*calls)

    outs = asyncio.run(main())
    assert all(o.token_ids == [2, 3] and o.stop_reason == StopReason.STOP for o in outs)
    assert Counter(o.extra_fields["server_index"] for o in outs) == dict.fromkeys(
        range(NUM_SERVERS), 2
    )
    stats = wait_idle(ray, balancer)
    assert stats == {
        "in_flight": [0] * NUM_SERVERS, "routed": [2] * NUM_SERVERS, "healthy": [1] * NUM_SERVERS,
    }


def test_sticky_across_managers_and_abort_reaches_the_bound_server(ray_session):
    ray = ray_session
    servers = server_actors(ray, NUM_SERVERS, delay=0.0)
    balancer = create_global_balancer(NUM_SERVERS)
    a, b = AsyncLLMServerManager(servers, balancer), AsyncLLMServerManager(servers, balancer)

    async def main():
        first = await a.generate("conv", prompt_ids=[1], sampling_params={})
        second = await b.generate("conv", prompt_ids=[1, 2], sampling_params={})
        await b.abort("conv")
        return first.extra_fields["server_index"], second.extra_fields["server_index"]

    first, second = asyncio.run(main())
    assert first == second
    calls = ray.get([s.__ray_call__.remote(lambda self: self.counts["abort"]) for s in servers])
    assert calls[first] == 1 and sum(calls) == 1


def test_cancellation_releases_during_acquire_and_during_generate(ray_session):
    ray = ray_session
    servers = server_actors(ray, 1, delay=5.0)
    balancer = create_global_balancer(1)
    mgr = AsyncLLMServerManager(servers, balancer)
    ray.get([servers[0].wake_up.remote(), balancer.stats.remote()])  # both actors are up

    async def cancel_after(seconds: float) -> None:
        task = asyncio.create_task(
            mgr.generate(f"slow{seconds}", prompt_ids=[1], sampling_params={})
        )
        await asyncio.sleep(seconds)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_after(0.0))  # still waiting for the balancer; the event loop then closes
    assert wait_idle(ray, balancer)["in_flight"] == [0]
    asyncio.run(cancel_after(0.5))  # waiting on the server
    assert wait_idle(ray, balancer) == {"in_flight": [0], "routed": [2], "healthy": [1]}


def test_dead_server_is_a_server_error_and_releases(ray_session):
    ray = ray_session
    servers = server_actors(ray, 1, delay=0.0)
    balancer = create_global_balancer(1)
    mgr = AsyncLLMServerManager(servers, balancer)
    kill_and_wait(servers[0])  # ray.kill returns before the actor is gone
    with pytest.raises(ServerError, match=r"server 0 died .* request dead"):
        asyncio.run(mgr.generate("dead", prompt_ids=[1], sampling_params={}))
    # out of routing
    assert wait_idle(ray, balancer) == {"in_flight": [0], "routed": [1], "healthy": [0]}


def test_calls_issued_together_share_one_ray_call_and_keep_their_own_results(ray_session):
    """The batcher: 64 requests → a couple of Ray calls; each caller gets its own reply or its
    own error."""

    class CallCounting(ScriptedServer):
        """Counts the ``generate_batch`` Ray calls and the requests they carry (``calls`` has
        them all)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.batch_calls = self.batched = 0

        async def generate_batch(
            self, requests: list[dict[str, Any]]
        ) -> AsyncIterator[list[tuple[int, Any]]]:
            self.batch_calls, self.batched = self.batch_calls + 1, self.batched + len(requests)
            async for group in super().generate_batch(requests):
                yield group

    actor_cls = ray_session.remote(num_cpus=0)(CallCounting)

    def reply(prompt_ids: list[int], params: dict, request_id: str) -> list[int]:
        if request_id == "r13":
            raise ServerError("boom on r13")
        return [int(request_id[1:]), 2]

    server = actor_cls.remote(reply, eos_token_id=2)
    manager = AsyncLLMServerManager([server])

    async def go() -> list[Any]:
        calls = [
            manager.generate(f"r{i}", prompt_ids=[1, 2, 3], sampling_params={}) for i in range(64)
        ]
        return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(go())
    assert isinstance(results[13], ServerError) and "boom on r13" in str(results[13])
    for i, out in enumerate(results):
        if i != 13:
            assert out.token_ids == [i, 2] and out.stop_reason == StopReason.STOP
    batch_calls, batched, requests = ray_session.get(
        server.__ray_call__.remote(lambda s: (s.batch_calls, s.batched, len(s.calls))))
    single_calls = requests - batched  # a batch of one goes as a plain generate call
    assert requests == 64 and batch_calls + single_calls <= 2


def test_a_cancelled_batched_call_aborts_the_request_on_the_server(ray_session):
    actor_cls = ray_session.remote(num_cpus=0)(ScriptedServer)
    server = actor_cls.remote(delay=30.0)
    manager = AsyncLLMServerManager([server])

    async def go() -> None:
        tasks = [
            asyncio.ensure_future(manager.generate(f"q{i}", prompt_ids=[1, 2], sampling_params={}))
            for i in range(3)
        ]
        await asyncio.sleep(1.0)
        tasks[1].cancel()
        await asyncio.sleep(1.0)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    t0 = time.monotonic()
    asyncio.run(go())
    assert time.monotonic() - t0 < 20
    deadline = time.monotonic() + 10
    while True:  # aborts are fire-and-forget actor calls
        counts = ray_session.get(server.__ray_call__.remote(lambda self: dict(self.counts)))
        if counts["abort"] >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert counts["abort"] >= 3


def _manager_on_scripted_servers(
    ray: Any, monkeypatch: pytest.MonkeyPatch, **overrides: Any
) -> Any:
    """An AgentLoopManager whose servers are ScriptedServer actors (the workers are real actors)."""
    import agentloop.rollout.manager as manager_module
    from agentloop.cluster.placement import ServerGroup
    from agentloop.config import default_config
    from agentloop.testing.tiny_model import ensure_tiny_model

    handles = server_actors(ray, 1, delay=0.0)
    cfg = default_config()
    cfg.actor_rollout_ref.model.path = str(ensure_tiny_model())
    cfg.data.max_response_length = 8
    for key, value in {"agent.num_workers": 2, "free_cache_engine": False, **overrides}.items():
        OmegaConf.update(cfg.actor_rollout_ref.rollout, key, value)
    # the documented injection point for servers started elsewhere
    return manager_module.AgentLoopManager(
        cfg, servers=ServerGroup(handles=handles, placement_group=None, device="cpu", info=[])
    )


def test_manager_waits_for_its_workers_and_raises_their_setup_errors(
    ray_session, monkeypatch, tmp_path
):
    """Worker set-up (tokenizer, tools) happens in the constructor: a broken tool config fails
    there, with its own message, not on the first batch; a good one leaves the first batch nothing
    to wait for.
    """
    from agentloop.errors import ConfigError

    bad = tmp_path / "tools.yaml"
    bad.write_text("tools:\n  - class_name: no.such.module.Tool\n    config: {}\n")
    with pytest.raises(ConfigError, match="no.such.module"):
        _manager_on_scripted_servers(
            ray_session, monkeypatch, **{"multi_turn.tool_config_path": str(bad)}
        )

    manager = _manager_on_scripted_servers(ray_session, monkeypatch)
    try:
        infos = ray_session.get([w.ready.remote() for w in manager.agent_loop_workers])
        assert len(infos) == 2 and all("tool_agent" in i["agent_loops"] for i in infos)
        assert all(i["priority"].startswith("nice") for i in infos)
        assert all(i["gc_frozen"] > 10_000 for i in infos)  # start-up heap out of full collections
        assert all(i["gc_threshold"] == 50_000 for i in infos)  # few young collections a batch
        from agentloop.batch.data import rows_to_batch

        out = manager.generate_sequences(
            rows_to_batch([{"prompt": [{"role": "user", "content": "hi"}]}] * 4)
        )
        assert len(out) == 4 and set(out.non_tensor_batch["status"].tolist()) <= {"stop", "length"}
    finally:
        manager.shutdown()


def test_manager_takes_verl_entry_points_and_shares_an_llm_client(ray_session, monkeypatch):
    """verl 0.9's AgentLoopManager.create(config, llm_client): the client's servers are used as they
    are (none started, none stopped); clear_kv_cache / profiling reach every server; verl's
    unsupported hooks are refused."""
    from agentloop.batch.data import rows_to_batch
    from agentloop.config import default_config
    from agentloop.errors import ConfigError
    from agentloop.rollout.manager import AgentLoopManager
    from agentloop.routing import LLMServerClient
    from agentloop.testing.tiny_model import ensure_tiny_model

    handles = server_actors(ray_session, 2, delay=0.0)
    cfg = default_config()
    cfg.actor_rollout_ref.model.path = str(ensure_tiny_model())
    cfg.data.max_response_length = 8
    OmegaConf.update(cfg.actor_rollout_ref.rollout, "agent.num_workers", 1)
    OmegaConf.update(cfg.actor_rollout_ref.rollout, "free_cache_engine", False)
    with pytest.raises(ConfigError, match="teacher_client"):
        AgentLoopManager(cfg, LLMServerClient(handles), teacher_client=object())
    manager = AgentLoopManager.create(cfg, LLMServerClient(handles))
    try:
        assert manager.server_handles == handles
        out = manager.generate_sequences(
            rows_to_batch([{"prompt": [{"role": "user", "content": "hi"}]}] * 3)
        )
        assert len(out) == 3 and len(out.meta_info["metrics"]) == 3
        manager.clear_kv_cache()
        manager.start_profile()
        manager.stop_profile()
        counts = ray_session.get([h.__ray_call__.remote(lambda s: s.counts) for h in handles])
        assert all(
            c["clear_kv_cache"] == 1 and c["start_profile"] == 1 and c["stop_profile"] == 1
            for c in counts
        )
    finally:
        manager.shutdown()
    # still alive: not ours to stop
    assert ray_session.get(handles[0].__ray_call__.remote(lambda s: s.name)) == "s0"


def test_a_failed_sample_on_one_worker_actor_leaves_its_neighbours_reward(
    ray_session, monkeypatch, tmp_path
):
    """Two real worker actors, verl's custom_reward_function: worker A's first sample fails in the
    engine, its neighbour's reward (and worker B's) stays 1.0; the failed row is reward_valid 0 with
    its reason.
    """
    import agentloop.rollout.manager as manager_module
    from agentloop.batch.data import rows_to_batch
    from agentloop.cluster.placement import ServerGroup
    from agentloop.config import default_config
    from agentloop.testing.tiny_model import ensure_tiny_model

    def reply(prompt_ids: list[int], params: dict, request_id: str) -> list[int]:
        if len(prompt_ids) > 40:  # the long prompt below
            raise ServerError("engine exploded")
        return prompt_ids[-2:]

    scorer = tmp_path / "reward.py"
    scorer.write_text(
        "def compute_score(data_source, solution_str, ground_truth, "
        "extra_info=None, **kwargs):\n"
        "    return {'score': float(ground_truth == 'yes'), 'source': data_source}\n"
    )
    handles = [ray_session.remote(num_cpus=0)(ScriptedServer).remote(reply)]
    cfg = default_config()
    cfg.actor_rollout_ref.model.path = str(ensure_tiny_model())
    cfg.data.max_response_length = 8
    cfg.custom_reward_function.path = str(scorer)
    OmegaConf.update(cfg.actor_rollout_ref.rollout, "agent.num_workers", 2)
    OmegaConf.update(cfg.actor_rollout_ref.rollout, "free_cache_engine", False)
    manager = manager_module.AgentLoopManager(
        cfg, servers=ServerGroup(handles=handles, placement_group=None, device="cpu", info=[])
    )
    try:
        rows = [{"prompt": [{"role": "user", "content": "fail " * 40 if i == 0 else f"hi {i}"}],
                 "data_source": "unit", "reward_model": {"ground_truth": "yes"}} for i in range(4)]
        out = manager.generate_sequences(rows_to_batch(rows))
        assert out.non_tensor_batch["status"].tolist() == ["error", "stop", "stop", "stop"]
        assert out.batch["rm_scores"].sum(-1).tolist() == [0.0, 1.0, 1.0, 1.0]
        assert out.batch["reward_valid"].tolist() == [0, 1, 1, 1]
        assert "status 'error'" in out.non_tensor_batch["reward_error"][0]
        assert out.non_tensor_batch["source"].tolist() == [None, "unit", "unit", "unit"]
        assert out.meta_info["reward_extra_keys"] == ["score", "source"]
        assert out.meta_info["timing"]["agent_loop/compute_score/max"] > 0
        assert out.meta_info["timing"]["agent_loop/reward/num_invalid"] == 1.0
    finally:
        manager.shutdown()
