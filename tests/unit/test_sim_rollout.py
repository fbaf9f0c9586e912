"""The rollout simulator (agentloop.testing.sim_rollout) driving the real balancer."""

from __future__ import annotations

from agentloop.routing.strategies import Balancer, LeastInFlight, make_balancer
from agentloop.testing.sim_rollout import ServerModel, Workload, make_trajectories, simulate

SMALL = Workload(trajectories=256, seed=3)


def test_the_makespan_is_never_below_its_lower_bound_and_runs_are_reproducible():
    first = simulate(lambda n: make_balancer(n, seed=1), SMALL, ServerModel(), servers=4)
    again = simulate(lambda n: make_balancer(n, seed=1), SMALL, ServerModel(), servers=4)
    assert first == again
    assert first["makespan_s"] >= first["lower_bound_s"] > 0 and first["ratio"] >= 1.0


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
