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

``--kv`` prints instead the KV-cache-aware routing comparison
(docs/routing.md#kv-cache-aware-routing-serverrouting-prefix): verl's sticky least-in-flight
(binding cache 10,000), the shipped policy (the same, cache grown to twice the batch), prefix
affinity (``server.routing: prefix``) with and without moves, on three workloads (no shared
prefixes; GRPO groups of 8 sharing a prompt under a shared system prompt; sub-agents forked from
their parent's context), synchronous batch and Rollouter (``abort``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from agentloop.routing.prefix_affinity import build_balancer
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

    def acquire(self, request_id: str, prompt_len: int = 0, prefix: tuple[int, ...] = ()) -> int:
        if request_id in self.lane:
            return self.last
        return self.inner.acquire(request_id, prompt_len, prefix=prefix)

    def release(self, server: int) -> None:
        if server != self.last:
            self.inner.release(server)


KV_WORKLOADS = {
    "no shared prefix": {},
    "GRPO n=8, system prompt": {"group_size": 8, "prompt_tokens": 1536, "system_tokens": 1024},
    "sub-agents (3 per trajectory)": {
        "trajectories": 1024, "subagents": 3, "prompt_tokens": 1536, "system_tokens": 1024,
    },
}
"""Per workload: :class:`Workload` fields over the defaults (``--trajectories`` scales them)."""


def kv_policies(seed: int, batch: int) -> dict[str, Callable[[int], Any]]:
    """The routing policies ``--kv`` compares, by name."""

    def shipped(n: int) -> Any:
        balancer = make_balancer(n, seed=seed)
        balancer.ensure_cache_capacity(2 * batch)  # as the manager does before each batch
        return balancer

    return {
        "verl: sticky + least in-flight (cache 10,000)": lambda n: make_balancer(n, seed=seed),
        "shipped: the same, cache grown to 2x batch": shipped,
        "prefix affinity (server.routing: prefix)": (
            lambda n: build_balancer(n, routing="prefix", seed=seed)
        ),
        "prefix affinity, no moves": (
            lambda n: build_balancer(n, routing="prefix", seed=seed, move_slack=None)
        ),
    }


def kv_main(args: argparse.Namespace) -> None:
    """The KV-cache-aware routing table (module docstring)."""
    m = ServerModel()
    print(f"{'servers':>7}  {'workload':<30} {'regime':<10} {'policy':<46} {'time s':>7} "
          f"{'ratio':>6} {'token hits':>10} {'turn hits':>9} {'moves':>6}")
    for servers in args.servers:
        for wname, fields in KV_WORKLOADS.items():
            scale = args.trajectories / 4096
            trajectories = max(1, round(fields.get("trajectories", 4096) * scale))
            w = Workload(**{**fields, "trajectories": trajectories, "seed": args.seed})
            total = trajectories * (1 + w.subagents)
            regimes = ["sync"] if w.subagents or args.no_stream else ["sync", "rollouter"]
            for regime in regimes:
                for pname, factory in kv_policies(args.seed, total).items():
                    made: list[Any] = []

                    def keep(
                        n: int, factory: Callable[[int], Any] = factory, made: list[Any] = made
                    ) -> Any:
                        made.append(factory(n))
                        return made[-1]

                    if regime == "sync":
                        r = simulate(keep, w, m, servers)
                        t = r["makespan_s"]
                    else:
                        r = simulate_stream(keep, w, m, servers, batches=args.batches,
                                            max_staleness=None, update="abort")
                        t = r["batch_s"]
                    moves = getattr(made[0].strategy, "moves", 0)
                    print(f"{servers:>7}  {wname:<30} {regime:<10} {pname:<46} {t:>7.1f} "
                          f"{r['ratio']:>6.3f} {r['prompt_token_hit_rate']:>10.1%} "
                          f"{r['prefix_hit_rate']:>9.0%} {moves:>6}", flush=True)


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
    parser.add_argument("--kv", action="store_true", help="the KV-cache-aware routing table only")
    args = parser.parse_args()
    if args.kv:
        kv_main(args)
        return
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
