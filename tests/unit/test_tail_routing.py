"""Tail-aware priority (rollout.server.priority): the policy, the router sending it, the engine
args, the simulator."""

from __future__ import annotations

import asyncio

import pytest

from agentloop.config import ServerSections, resolve_config
from agentloop.errors import ConfigError
from agentloop.routing import AsyncLLMServerManager
from agentloop.routing.strategies import make_balancer
from agentloop.routing.tail import ContextPriority, make_priority
from agentloop.servers.vllm import engine_args
from agentloop.testing import ScriptedServer
from agentloop.testing.sim_rollout import ServerModel, Workload, simulate, simulate_stream


def test_longer_contexts_get_lower_values_so_vllm_serves_them_first():
    rank = ContextPriority(bucket=100)
    assert rank("a", 950) < rank("b", 420) < rank("c", 99) == 0
    assert rank("a", 120) == rank("b", 180)  # one bucket: arrival order decides
    assert make_priority(None) is None and make_priority("fcfs") is None
    assert isinstance(make_priority("context"), ContextPriority)
    with pytest.raises(ConfigError, match="server.priority='longest'.*null.*context"):
        make_priority("longest")


def test_the_router_sends_the_priority_only_when_a_policy_is_set():
    async def run(policy, **kwargs):
        server = ScriptedServer(lambda ids, p, rid: [7])
        router = AsyncLLMServerManager([server], priority=policy)
        await router.generate(
            "r1", prompt_ids=list(range(600)), sampling_params={"max_tokens": 4}, **kwargs
        )
        return server.calls[-1]["sampling_params"]

    assert "priority" not in asyncio.run(run(None))
    assert asyncio.run(run(ContextPriority(bucket=256)))["priority"] == -2
    # the caller's own priority wins
    assert asyncio.run(run(ContextPriority(), priority=-9))["priority"] == -9
    # fcfs engines would reject a priority
    assert "priority" not in asyncio.run(run(None, priority=-9))


def test_priority_context_switches_the_engine_to_priority_scheduling(tmp_path):
    (tmp_path / "config.json").write_text("{}")

    def args(server):
        cfg = resolve_config({"actor_rollout_ref": {"model": {"path": str(tmp_path)},
                                                    "rollout": {"server": server}}, "data": {}})
        return engine_args(cfg.engine, cfg.server, cfg.model_config, on_cpu=True)

    assert args({})["scheduling_policy"] == "fcfs"
    assert args({"priority": "context"})["scheduling_policy"] == "priority"
    with pytest.raises(ConfigError, match="server.priority"):
        args({"priority": "tokens"})


SMALL = Workload(trajectories=192, seed=5)


def test_priority_reorders_a_queueing_server_in_the_simulator():
    queueing = ServerModel(max_batch=8)
    fcfs = simulate(lambda n: make_balancer(n, seed=0), SMALL, queueing, servers=2)
    ranked = simulate(
        lambda n: make_balancer(n, seed=0), SMALL, queueing, servers=2, priority=ContextPriority(64)
    )
    assert fcfs["makespan_s"] != ranked["makespan_s"]
    assert min(fcfs["ratio"], ranked["ratio"]) >= 1.0
    roomy = ServerModel(max_batch=4096)  # nothing ever waits: the order cannot matter
    assert (simulate(lambda n: make_balancer(n, seed=0), SMALL, roomy, servers=2)["makespan_s"]
            == simulate(lambda n: make_balancer(n, seed=0), SMALL, roomy, servers=2,
                        priority=ContextPriority(64))["makespan_s"])


def test_the_rollouter_regime_hands_out_batches_before_the_stragglers_finish():
    sync = simulate(lambda n: make_balancer(n, seed=0), SMALL, ServerModel(), servers=2)
    free = simulate_stream(
        lambda n: make_balancer(n, seed=0), SMALL, ServerModel(), servers=2, batches=4,
        max_staleness=None,
    )
    assert free == simulate_stream(
        lambda n: make_balancer(n, seed=0), SMALL, ServerModel(), servers=2, batches=4,
        max_staleness=None,
    )  # reproducible
    assert free["wasted_tokens"] == 0 and free["batch_s"] < sync["makespan_s"]
    # the first hand-out does not wait for the longest trajectory
    assert free["first_batch_s"] < sync["makespan_s"]
    bounded = simulate_stream(
        lambda n: make_balancer(n, seed=0), SMALL, ServerModel(), servers=2, batches=4,
        max_staleness=0,
    )
    assert bounded["wasted_tokens"] > 0 and bounded["mean_staleness"] == 0
    with pytest.raises(ValueError, match="batches >= 2"):
        simulate_stream(
            lambda n: make_balancer(n, seed=0), SMALL, ServerModel(), servers=2, batches=1
        )


def test_weight_update_mode_is_checked_before_any_server_starts(tmp_path):
    (tmp_path / "config.json").write_text("{}")

    def resolve(server, **root):
        return resolve_config(
            {
                "actor_rollout_ref": {
                    "model": {"path": str(tmp_path)},
                    "rollout": {"server": server},
                },
                "data": {},
                **root,
            }
        )

    # default: abort, verl's fully-async partial rollout; without partial rollouts (verl's key set
    # false) drain
    assert resolve({}).rollout.server.weight_update == "abort"
    assert (
        resolve({}, async_training={"partial_rollout": True}).rollout.server.weight_update
        == "abort"
    )
    assert (
        resolve({}, async_training={"partial_rollout": False}).rollout.server.weight_update
        == "drain"
    )
    assert resolve({"weight_update": "abort"}, async_training={"partial_rollout": False}
                   ).rollout.server.weight_update == "abort"  # said outright: kept
    for mode in ("drain", "keep"):
        assert resolve({"weight_update": mode}).rollout.server.weight_update == mode
    with pytest.raises(ConfigError, match="server.weight_update"):
        resolve({"weight_update": "wait"})
    with pytest.raises(ConfigError, match="keep is implemented for vLLM only"):
        resolve_config({"actor_rollout_ref": {"model": {"path": str(tmp_path)}, "rollout": {
            "name": "sglang", "server": {"weight_update": "keep"}}}, "data": {}})


def test_in_the_simulator_keeping_kv_across_updates_beats_aborting_which_beats_draining():
    def ratio(update):
        return simulate_stream(
            lambda n: make_balancer(n, seed=0), Workload(trajectories=256, seed=3), ServerModel(),
            servers=2, batches=4, max_staleness=None, update=update,
        )["ratio"]

    keep, abort, drain = ratio("keep"), ratio("abort"), ratio("drain")
    assert keep < abort < drain
    with pytest.raises(ValueError, match="update must be"):
        ratio("wait")


def test_keep_mode_tags_each_token_with_the_version_current_when_it_was_sampled(tmp_path):
    from agentloop.servers.vllm import VLLMServer

    (tmp_path / "config.json").write_text("{}")
    cfg = resolve_config(
        {
            "actor_rollout_ref": {
                "model": {"path": str(tmp_path)},
                "rollout": {"server": {"weight_update": "keep"}},
            },
            "data": {},
        }
    )
    server = VLLMServer(ServerSections.of(cfg))
    assert server.keep_kv_on_update
    # tokens so far at the switches to 5, 6
    server.inflight.switches = {"r": [(3, 5), (7, 6)], "short": [(9, 5)]}
    assert server.inflight.token_versions("r", 4, 10) == [4] * 3 + [5] * 4 + [6] * 3
    # ended (cut) before that count: no new token
    assert server.inflight.token_versions("short", 4, 2) == [4, 4]
    assert (
        server.inflight.token_versions("never-switched", 4, 2) == [4, 4]
        and server.inflight.switches == {}
    )
