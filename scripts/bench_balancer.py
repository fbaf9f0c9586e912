"""Balancer decisions per second at 8 / 64 / 256 servers: the local Balancer and the GlobalBalancer
actor.

A decision is one ``acquire`` (sticky miss, so least in-flight chooses) plus the ``release`` of a
request that started earlier; every request id is distinct (``--requests``, default 100k) and the
sticky cache is grown to hold all of them, as the manager does for a batch.  In-flight requests are
kept at ``--window-per-server`` per server, releasing a random one of them each time (so counts
differ and ties vary, as under real load).

Paths measured, each with the shipped ``LeastInFlight`` (``new``) and the previous list-scan
implementation kept below as :class:`OldLeastInFlight` (``old``, the baseline), alternating old/new
passes; the local path also runs :class:`~agentloop.routing.strategies.BucketedLeastInFlight` (O(log
N), make_balancer's from 32 servers):

* ``local``: :func:`agentloop.routing.strategies.make_balancer` in this process.
* ``actor batched``: the GlobalBalancer actor through
  :class:`~agentloop.routing.balancer_actor.RemoteBalancer`, the router's client
  (``AsyncLLMServerManager._acquire``): ``--callers`` concurrent coroutines each acquire, then
  release and acquire again; the client coalesces whatever is queued into one ``acquire_many`` call.
* ``actor unbatched``: one ``acquire.remote`` and one ``release.remote`` per decision (``--callers``
  coroutines, ``--unbatched-requests`` decisions, default 5k: it is ~100x slower).

    python scripts/bench_balancer.py [--servers 8,64,256] [--requests 100000] [--repeats 3]
    [--no-actor]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from agentloop.routing.balancer_actor import BalancerActor, RemoteBalancer
from agentloop.routing.strategies import (
    Balancer,
    BucketedLeastInFlight,
    LeastInFlight,
    RouteContext,
    StickySession,
)


class OldLeastInFlight:
    """Baseline: the previous ``LeastInFlight.choose`` (a Python-level scan building the tied
    list)."""

    def __init__(self, tie_break: str = "random", seed: int | None = None) -> None:
        self.tie_break = tie_break
        self._rng = random.Random(seed)
        self._cursor = 0

    def choose(self, ctx: RouteContext, in_flight: Sequence[int]) -> int:
        low = min(in_flight)
        tied = [i for i, c in enumerate(in_flight) if c == low]
        if len(tied) == 1:
            return tied[0]
        if self.tie_break == "random":
            return self._rng.choice(tied)
        self._cursor += 1
        return tied[self._cursor % len(tied)]


def _balancer(num_servers: int, old: bool | None, requests: int) -> Balancer:
    if old is None:  # bucketed, O(log N): what make_balancer uses from 32 servers on
        return Balancer(
            num_servers, StickySession(BucketedLeastInFlight(seed=0), max_cache_size=2 * requests)
        )
    inner: Any = OldLeastInFlight(seed=0) if old else LeastInFlight(seed=0)
    return Balancer(num_servers, StickySession(inner, max_cache_size=2 * requests))


def bench_local(
    num_servers: int, old: bool | None, requests: int, window: int
) -> tuple[float, list[int]]:
    """Decisions/s of the local balancer, and the servers chosen (to check old == new)."""
    balancer = _balancer(num_servers, old, requests)
    ids = [f"req-{i}" for i in range(requests)]
    picks = random.Random(1).choices(range(window), k=requests)
    live: list[int] = []
    chosen: list[int] = []
    start = time.perf_counter()
    for rid, pick in zip(ids, picks, strict=True):
        server = balancer.acquire(rid)
        chosen.append(server)
        if len(live) < window:
            live.append(server)
            continue
        balancer.release(live[pick])
        live[pick] = server
    return requests / (time.perf_counter() - start), chosen


class BenchBalancerActor(BalancerActor):
    """The GlobalBalancer actor body, optionally with the baseline strategy inside."""

    def __init__(self, num_servers: int, old: bool, requests: int) -> None:
        super().__init__(num_servers, seed=0)
        if old:
            self.balancer.strategy.fallback = OldLeastInFlight(seed=0)  # type: ignore[attr-defined]
        self.balancer.ensure_cache_capacity(2 * requests)


async def _drive(
    acquire: Callable[[str], Any], release: Callable[[int], Any], requests: int, callers: int
) -> float:
    """``callers`` coroutines doing acquire / release until ``requests`` decisions; returns
    decisions/s."""
    ids = iter([f"req-{i}" for i in range(requests)])

    async def caller() -> None:
        held: int | None = None
        for rid in ids:
            server = await acquire(rid)
            if held is not None:
                await release(held)
            held = server
        if held is not None:
            await release(held)

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    return requests / (time.perf_counter() - start)


def bench_actor(num_servers: int, old: bool, requests: int, callers: int, batched: bool) -> float:
    import ray

    handle = (
        ray.remote(BenchBalancerActor)
        .options(num_cpus=0, max_concurrency=1)
        .remote(num_servers, old, requests)
    )
    ray.get(handle.stats.remote())
    try:
        if batched:
            client = RemoteBalancer(handle, owner="bench")

            async def release_batched(server: int) -> None:
                client.release(server)

            async def run() -> float:
                rate = await _drive(client.acquire, release_batched, requests, callers)
                await handle.stats.remote()  # the last releases have landed
                return rate
        else:
            async def acquire_one(rid: str) -> int:
                return int(await handle.acquire.remote(rid))

            async def release_one(server: int) -> None:
                await handle.release.remote(server)

            async def run() -> float:
                return await _drive(acquire_one, release_one, requests, callers)

        return asyncio.run(run())
    finally:
        ray.kill(handle)


def _summary(rates: list[float]) -> str:
    return f"{statistics.median(rates):>10,.0f} ({min(rates):,.0f}-{max(rates):,.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--servers", default="8,64,256")
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--unbatched-requests", type=int, default=5_000)
    parser.add_argument("--window-per-server", type=int, default=4)
    parser.add_argument(
        "--callers", type=int, default=1024, help="concurrent callers of the actor paths"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-actor", action="store_true", help="only the local balancer (no Ray)")
    args = parser.parse_args()
    servers = [int(s) for s in args.servers.split(",")]
    rows: list[tuple[int, str, list[float], list[float], list[float]]] = []
    for n in servers:
        local: dict[bool | None, list[float]] = {True: [], False: [], None: []}
        chosen: dict[bool | None, list[int]] = {}
        for _ in range(args.repeats):
            for variant in (True, False, None):
                rate, chosen[variant] = bench_local(
                    n, variant, args.requests, args.window_per_server * n
                )
                local[variant].append(rate)
        if not chosen[True] == chosen[False] == chosen[None]:
            raise SystemExit(
                f"{n} servers: the new LeastInFlight (or the bucketed one) "
                f"chose differently from the old"
            )
        rows.append((n, "local", local[True], local[False], local[None]))
        print(f"[{n} servers] local done (same choices: yes)", flush=True)
    if not args.no_actor:
        import ray

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
        try:
            for n in servers:
                for batched, label, count in ((True, "actor batched", args.requests),
                                              (False, "actor unbatched", args.unbatched_requests)):
                    rates: dict[bool, list[float]] = {True: [], False: []}
                    for _ in range(args.repeats):
                        for old in (True, False):
                            rates[old].append(bench_actor(n, old, count, args.callers, batched))
                    rows.append((n, label, rates[True], rates[False], []))
                    print(f"[{n} servers] {label} done", flush=True)
        finally:
            ray.shutdown()
    print(
        f"\ndecisions/s (acquire + release), {args.requests:,} distinct request ids "
        f"({args.unbatched_requests:,} "
        f"unbatched), {args.window_per_server} in flight per server, median (min-max) of "
        f"{args.repeats} "
        "alternating passes\n"
    )
    print(
        "| servers | path | old LeastInFlight | new LeastInFlight | new / old | bucketed, "
        "O(log N) "
        "(shipped from 32 servers) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for n, label, old_rates, new_rates, proto in rows:
        ratio = statistics.median(new_rates) / statistics.median(old_rates)
        print(f"| {n} | {label} | {_summary(old_rates)} | {_summary(new_rates)} | {ratio:.2f} | "
              f"{_summary(proto) if proto else '-'} |")


if __name__ == "__main__":
    main()
