"""The health check after a batch at fleet sizes: ``ServerSupervisor.check`` against the one-by-one
collection it replaced, alternating, in one run.

``generate_sequences`` probes every server after a batch (``check_health``, docs/faults.md) and the
driver waits for the answers before it returns. The previous design waited for all of them
(``ray.wait``) and then fetched each answer with its own ``ray.get``; the shipped check fetches them
all in one ``ray.get`` and goes one by one only when a server is dead or slow. As in
``scripts/bench_fleet.py``, a few ``ScriptedServer`` actors stand in for many servers (each handle
repeated in the server list), and the probes are answered before the timer starts (the manager sends
them while the last rows are on their way). Prints per fleet size the median ms per check and the
ratio shipped / previous.

    RAY_AUTH_MODE=disabled python scripts/bench_health_check.py [--servers 64 256 1024] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import ray

from agentloop.cluster.placement import ServerGroup
from agentloop.cluster.supervisor import ServerSupervisor
from agentloop.testing import ScriptedServer


def previous_check(probe: dict[int, Any], timeout: float) -> list[int]:
    """The collection before: wait for every answer, then one ``ray.get`` per server."""
    refs = list(probe.values())
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    dead = []
    for i, ref in probe.items():
        if ref in done:
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001 - a dead server, as the check counts it
                dead.append(i)
    return dead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--actors", type=int, default=8, help="server actors standing in for them")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    actor = ray.remote(num_cpus=0)(ScriptedServer).options(max_concurrency=4096)
    actors = [actor.remote([]) for _ in range(args.actors)]
    ray.get([a.check_health.remote() for a in actors])
    print(f"health check after a batch, probes answered; {args.actors} server actors; median of "
          f"{args.rounds} alternating rounds")
    for n in args.servers:
        handles = [actors[i % len(actors)] for i in range(n)]
        group = ServerGroup(handles=handles, placement_group=None, device="cpu",
                            info=[{}] * n, placement="standalone")
        supervisor = ServerSupervisor(group=group, balancer=None, swap=lambda i, h: None,
                                      restart=False)
        times: dict[str, list[float]] = {"previous": [], "shipped": []}
        for _ in range(args.rounds):
            for name in times:
                probe = supervisor.probe()
                ray.wait(list(probe.values()), num_returns=len(probe))
                t0 = time.perf_counter()
                dead = (previous_check(probe, supervisor.health_timeout_s) if name == "previous"
                        else supervisor.check(probe))
                times[name].append((time.perf_counter() - t0) * 1e3)
                if dead:
                    raise SystemExit(f"servers {dead} reported dead; every server is alive here")
        prev, new = (statistics.median(times[k]) for k in ("previous", "shipped"))
        ratios = [b / a for a, b in zip(times["previous"], times["shipped"], strict=True)]
        print(f"  {n:5d} servers: previous {prev:7.2f} ms, shipped {new:6.2f} ms; "
              f"shipped / previous paired median {statistics.median(ratios):.3f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
