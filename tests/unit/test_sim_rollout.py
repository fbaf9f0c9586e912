"""The rollout simulator (agentloop.testing.sim_rollout) driving the real balancer."""

from __future__ import annotations

from agentloop.routing.strategies import Balancer, LeastInFlight, make_balancer
from agentloop.testing.sim_rollout import (
    ServerModel,
    Workload,
    lower_bound,
    make_trajectories,
    simulate,
    simulate_stream,
)

SMALL = Workload(trajectories=256, seed=3)


def test_the_makespan_is_never_below_its_lower_bound_and_runs_are_reproducible():
    first = simulate(lambda n: make_balancer(n, seed=1), SMALL, ServerModel(), servers=4)
    again = simulate(lambda n: make_balancer(n, seed=1), SMALL, ServerModel(), servers=4)
    assert first == again
    assert first["makespan_s"] >= first["lower_bound_s"] > 0 and first["ratio"] >= 1.0


def test_the_bound_counts_the_prefill_every_schedule_pays_and_the_updates_pause():
    """Prompts and tool results are work too: the bound is every token at full batch plus every
    prompt and tool result prefilled once, over the servers; the decode-only bound leaves the
    prefill out."""
    many = Workload(trajectories=2048, seed=3)
    m = ServerModel()
    trajs = make_trajectories(many)
    tokens = sum(sum(t.turns) for t in trajs)
    prefill = sum(many.prompt_tokens + many.tool_tokens * (len(t.turns) - 1) for t in trajs)
    want = tokens * (m.step_b + m.step_a / m.max_batch) + prefill * m.prefill_per_token
    # one server: the work dominates
    assert abs(lower_bound(trajs, many, m, servers=1) - want) < 1e-6
    dear = ServerModel(prefill_per_token=0.002)
    a = simulate(lambda n: make_balancer(n, seed=1), SMALL, m, servers=4)
    b = simulate(lambda n: make_balancer(n, seed=1), SMALL, dear, servers=4)
    assert a["decode_bound_s"] == b["decode_bound_s"] < a["lower_bound_s"] < b["lower_bound_s"]
    assert b["makespan_s"] >= b["lower_bound_s"] and a["makespan_s"] >= a["lower_bound_s"]
    stream = {s: simulate_stream(lambda n: make_balancer(n, seed=0), SMALL, m, servers=2, batches=3,
                                 max_staleness=None, sync_s=s) for s in (0.0, 5.0)}
    # the pause, once per hand-out
    assert stream[5.0]["work_bound_s"] > stream[5.0]["decode_bound_s"] + 5.0
    assert stream[0.0]["ratio"] < stream[0.0]["decode_ratio"]


def test_stickiness_keeps_later_turns_on_their_server_and_least_in_flight_alone_does_not():
    sticky = simulate(lambda n: make_balancer(n, seed=1), SMALL, ServerModel(), servers=4)
    loose = simulate(lambda n: Balancer(n, LeastInFlight(seed=1)), SMALL, ServerModel(), servers=4)
    assert sticky["prefix_hit_rate"] == 1.0 and loose["prefix_hit_rate"] < 0.6


def test_the_balancer_sees_every_turn_acquired_and_released():
    calls = {"acquire": 0, "release": 0}

    class Counting:
        def __init__(self, n):
            self.inner = make_balancer(n, seed=0)

        def acquire(self, request_id, prompt_len=0):
            calls["acquire"] += 1
            return self.inner.acquire(request_id, prompt_len)

        def release(self, server):
            calls["release"] += 1
            self.inner.release(server)

    simulate(Counting, SMALL, ServerModel(), servers=2)
    turns = sum(len(t.turns) for t in make_trajectories(SMALL))
    assert calls == {"acquire": turns, "release": turns}
