"""Simulated multi-turn rollout (agentloop.testing.sim_rollout) through agentloop's balancer: makespan / lower bound.

    python scripts/sim_rollout.py [--trajectories 4096] [--servers 8 16] [--seed 0]

Compares the shipped balancer (sticky by request id over least-in-flight, verl's algorithm) with plain
least-in-flight (no stickiness: every turn may land elsewhere and re-prefills its context).
"""

from __future__ import annotations

import argparse
import time

from agentloop.routing.strategies import Balancer, LeastInFlight, make_balancer
from agentloop.testing.sim_rollout import ServerModel, Workload, simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, default=4096)
    parser.add_argument("--servers", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    strategies = {
        "sticky + least in-flight (shipped)": lambda n: make_balancer(n, seed=args.seed),
        "least in-flight, no stickiness": lambda n: Balancer(n, LeastInFlight(seed=args.seed)),
    }
    print(f"{'servers':>7}  {'strategy':<36} {'makespan s':>10} {'bound s':>8} {'ratio':>6} {'prefix hits':>11} "
          f"{'imbalance':>9}")
    for servers in args.servers:
        for name, factory in strategies.items():
            t0 = time.perf_counter()
            r = simulate(factory, Workload(trajectories=args.trajectories, seed=args.seed), ServerModel(), servers)
            print(f"{servers:>7}  {name:<36} {r['makespan_s']:>10.1f} {r['lower_bound_s']:>8.1f} {r['ratio']:>6.2f} "
                  f"{r['prefix_hit_rate']:>11.0%} {r['load_imbalance']:>9.2f}   ({time.perf_counter() - t0:.1f}s)")


if __name__ == "__main__":
    main()
