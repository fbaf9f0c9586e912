"""Simulated multi-turn rollout (agentloop.testing.sim_rollout) through agentloop's balancer: time /
lower bound.

    python scripts/sim_rollout.py [--trajectories 4096] [--servers 8 16] [--seed 0] [--batches 8]

Synchronous batch (``generate_sequences``, verl's trainer step): the shipped balancer (sticky by
request id over least in-flight, verl's algorithm), plain least-in-flight, the shipped balancer with
context priority (``rollout.server.priority: context``), and an oracle that knows every trajectory's
length and gives the longest ones a server of their own (what no online router can beat by much: how
far the lower bound is from reach).

Rollouter regime (a batch handed out as soon as that many trajectories finished, the rest carry
over; a weight update after each hand-out): unbounded staleness and ``max_staleness: 1``, with and
without context priority, and the three ways an update can treat the running requests
(``rollout.server.weight_update``; ``--updates``, default all): ``abort`` (the default: cut,
resumed, contexts re-read), ``drain`` (running requests finish first, new ones wait) and ``keep``
(frozen, then go on with their KV cache).  Ratio = time per hand-out / the work bound of the
trajectories handed out (their tokens at full batch, their prompts and tool results prefilled once,
the update's pause); "decode" = against their tokens alone (the bound before prefill was counted).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from agentloop.routing.strategies import Balancer, LeastInFlight, make_balancer
from agentloop.routing.tail import ContextPriority
from agentloop.testing.sim_rollout import (
    ServerModel,
    Workload,
    make_trajectories,
    simulate,
    simulate_stream,
)


class OracleLane:
    """Knows every trajectory's length: the ``lane`` longest get the last server to themselves."""

    def __init__(
        self, servers: int, workload: Workload, model: ServerModel, lane: int, seed: int
    ) -> None:
        per_token = model.step_a + model.step_b
        alone = {
            f"traj-{t.index}": sum(t.turns) * per_token + sum(t.tools)
            for t in make_trajectories(workload)
        }
        self.lane = set(sorted(alone, key=lambda k: -alone[k])[:lane])
        self.inner = make_balancer(servers - 1, seed=seed)
        self.last = servers - 1

    def acquire(self, request_id: str, prompt_len: int = 0) -> int:
        return self.last if request_id in self.lane else self.inner.acquire(request_id, prompt_len)

    def release(self, server: int) -> None:
        if server != self.last:
            self.inner.release(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, default=4096)
    parser.add_argument("--servers", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--batches", type=int, default=8,
        help="hand-outs per Rollouter run (the first is the cold start and not counted)",
    )
    parser.add_argument("--no-stream", action="store_true", help="only the synchronous batch")
    parser.add_argument(
        "--updates", nargs="+", default=["abort", "drain", "keep"],
        choices=["abort", "drain", "keep"],
    )
    args = parser.parse_args()
    w, m = Workload(trajectories=args.trajectories, seed=args.seed), ServerModel()
    shipped: Callable[[int], Any] = lambda n: make_balancer(n, seed=args.seed)  # noqa: E731
    print(
        f"{'servers':>7}  {'synchronous batch':<44} {'makespan s':>10} {'bound s':>8} "
        f"{'ratio':>6} "
        f"{'decode':>6} {'prefix hits':>11}"
    )
    for servers in args.servers:
        rows: list[tuple[str, Callable[[int], Any], Any]] = [
            ("sticky + least in-flight (shipped, verl's)", shipped, None),
            (
                "least in-flight, no stickiness",
                lambda n: Balancer(n, LeastInFlight(seed=args.seed)), None,
            ),
            ("shipped + priority: context", shipped, ContextPriority()),
        ]
        rows += [
            (
                f"oracle: {k} longest on a server of their own",
                (lambda n, k=k: OracleLane(n, w, m, k, args.seed)), None,
            )
            for k in (8, 32)
        ]
        for name, factory, priority in rows:
            t0 = time.perf_counter()
            r = simulate(factory, w, m, servers, priority=priority)
            print(
                f"{servers:>7}  {name:<44} {r['makespan_s']:>10.1f} "
                f"{r['lower_bound_s']:>8.1f} {r['ratio']:>6.3f} "
                f"{r['decode_ratio']:>6.3f} {r['prefix_hit_rate']:>11.0%}   "
                f"({time.perf_counter() - t0:.1f}s)"
            )
    if args.no_stream:
        return
    print(
        f"\n{'servers':>7}  {'Rollouter: update, staleness, priority':<44} "
        f"{'batch s':>10} {'bound s':>8} "
        f"{'ratio':>6} {'decode':>6} {'wasted':>7} {'staleness':>9}"
    )
    for servers in args.servers:
        for update, staleness, priority in [(u, s, p) for u in args.updates for s in (None, 1)
                                            for p in (None, ContextPriority())]:
            name = (
                f"{update}, max_staleness {staleness}, priority {'context' if priority else 'fcfs'}"
            )
            t0 = time.perf_counter()
            r = simulate_stream(
                shipped, w, m, servers, batches=args.batches, max_staleness=staleness,
                priority=priority, update=update,
            )
            print(
                f"{servers:>7}  {name:<44} {r['batch_s']:>10.1f} "
                f"{r['work_bound_s']:>8.1f} {r['ratio']:>6.3f} "
                f"{r['decode_ratio']:>6.3f} {r['wasted_tokens']:>7.0%} "
                f"{r['mean_staleness']:>9.2f}   "
                f"({time.perf_counter() - t0:.1f}s)"
            )


if __name__ == "__main__":
    main()
