"""Fleet rehearsal: the real manager, worker pool, balancer actor and router at 64 / 256 / 1,024
servers, without GPUs.

A ``ray.cluster_utils.Cluster`` of ``--nodes`` simulated nodes on this machine; ``--hosts``
:class:`~agentloop.testing.fleet.FleetServer` actors (spread over the nodes) stand in for the
servers, each repeated in the server list so the manager routes over ``--servers`` virtual servers
(``AgentLoopManager(config, servers=ServerGroup(...))``, agentloop/testing/fleet.py).  Every
trajectory is the ``fleet_agent`` loop: ``--turns`` generate calls with one request id.  Per
setting it runs a warm-up step, then ``--steps`` timed ``generate_sequences`` steps of
``--trajectories`` samples, and prints:

* samples/s and generate calls/s of the step (the server answers in ``--latency`` +
  ``--tokens`` / ``--token-rate`` seconds, so what limits the rate is the stack);
* the wait for the balancer per generate call (router ``acquire``: queue + actor round trip +
  decision), p50 / p99, and the loop's whole call time p50 / p99;
* CPU seconds per 1,000 calls and the busiest process's share of one core, per role (driver,
  balancer actor, workers, server hosts), and each role's resident memory;
* where it saturates first: the single-process role (driver, balancer) with the highest CPU cost
  per call caps the calls/s of any fleet at ``1 / cost``; workers and hosts scale out.

    python scripts/bench_fleet.py [--servers 64,256,1024] [--trajectories 10000] [--turns 10]
    [--workers 8] [--nodes 4] [--hosts 8] [--steps 1] [--routing shared,local] [--json PATH]

``--routing`` takes ``rollout.server.balancer`` values (``shared``: the balancer actor, the
default; ``local``: worker-local routers), run one after the other per server count.
``--agent tool_agent``: the shipped ``tool_agent`` (hermes format, the real calculator tool, the
tiny model's tokenizer and chat template) instead of ``fleet_agent``; each server replies with a
tool call, then with the answer once the call is in the context, so a trajectory makes 2 generate
calls and 1 tool call (the balancer wait is not recorded: ``tool_agent`` is not instrumented).
``--placement``: no Ray; the busiest server's in-flight count once a step's ``--trajectories`` are
placed, by one shared balancer vs ``--workers`` worker-local ones (the balance ``local`` gives up).

Results and the 128-GPU arithmetic: docs/benchmarks.md, "Fleet rehearsal".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import ray  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from agentloop.batch.data import rows_to_batch  # noqa: E402
from agentloop.batch.protocol import DataProto  # noqa: E402
from agentloop.cluster.placement import ServerGroup  # noqa: E402
from agentloop.config import default_config  # noqa: E402
from agentloop.rollout.manager import AgentLoopManager  # noqa: E402
from agentloop.routing.strategies import make_balancer  # noqa: E402
from agentloop.testing.fleet import (  # noqa: E402
    process_report,
    start_fleet_hosts,
    virtual_servers,
)
from agentloop.testing.tiny_model import ensure_tiny_model  # noqa: E402
from agentloop.tokenization.loader import load_tokenizer  # noqa: E402

TOOLS_YAML = Path(__file__).resolve().parent.parent / "examples" / "calculator_agent" / "tools.yaml"
ROLES = ("driver", "balancer", "workers", "hosts")


def start_cluster(nodes: int, cpus_per_node: int) -> tuple[Cluster, list[str]]:
    """A simulated cluster of ``nodes`` nodes; returns it and the node ids (head first)."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": cpus_per_node, "include_dashboard": False},
    )
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=cpus_per_node)
    ray.init(address=cluster.address, logging_level="ERROR")
    cluster.wait_for_nodes()
    ids = [cluster.head_node.node_id] + [
        n.node_id for n in cluster.worker_nodes if n.node_id != cluster.head_node.node_id
    ]
    return cluster, ids


def fleet_config(args: argparse.Namespace, routing: str) -> Any:
    """The rollout config of every setting: ``fleet_agent``, no sleep, budgets that fit, and
    ``rollout.server.balancer`` = ``routing`` (``shared``: the balancer actor; ``local``: each
    worker's router on its own, its sticky cache grown to its share of the batch)."""
    cfg = default_config()
    cfg.actor_rollout_ref.model.path = str(ensure_tiny_model())
    cfg.data.max_prompt_length = 32
    cfg.data.max_response_length = args.turns * (args.tokens + 2)
    settings: dict[str, Any] = {
        "agent.num_workers": args.workers, "agent.default_agent_loop": args.agent,
        "server.device": "cpu", "free_cache_engine": False, "server.balancer": routing,
    }
    if args.agent == "tool_agent":
        cfg.data.max_prompt_length, cfg.data.max_response_length = 256, 128
        settings.update({
            "multi_turn.enable": True, "multi_turn.format": "hermes",
            "multi_turn.max_assistant_turns": 3, "multi_turn.tool_config_path": str(TOOLS_YAML),
        })
    for key, value in settings.items():
        OmegaConf.update(cfg.actor_rollout_ref.rollout, key, value)
    return cfg


def tool_replies(cfg: Any) -> dict[str, list[int]]:
    """``--agent tool_agent``: the servers' two replies (a calculator call, then the answer)."""
    tok = load_tokenizer(cfg.actor_rollout_ref.model)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
    return {
        "call_ids": tok.encode(call, add_special_tokens=False) + [tok.eos_token_id],
        "answer_ids": tok.encode("The answer is 5.", add_special_tokens=False)
        + [tok.eos_token_id],
    }


def make_batch(args: argparse.Namespace, n: int) -> DataProto:
    """``n`` samples: fleet_agent ones of ``--turns`` turns, or tool_agent questions."""
    if args.agent == "tool_agent":
        return rows_to_batch([
            {"prompt": [{"role": "user", "content": f"What is {i} plus {i + 7}?"}]}
            for i in range(n)
        ])
    return rows_to_batch([
        {"prompt": [{"role": "user", "content": f"q{i}"}], "turns": args.turns,
         "tokens_per_turn": args.tokens}
        for i in range(n)
    ])


def _reports(actors: list[Any], reset: bool) -> list[dict[str, Any]]:
    return ray.get([a.__ray_call__.remote(lambda _self: process_report(reset)) for a in actors])


def snapshot(manager: AgentLoopManager, hosts: list[Any], reset: bool) -> dict[str, Any]:
    """CPU, memory (and latency samples) of every process, by role."""
    return {
        "driver": [process_report(reset)],
        "balancer": _reports([manager.balancer], reset) if manager.balancer is not None else [],
        "workers": _reports(list(manager.agent_loop_workers), reset),
        "hosts": _reports(hosts, reset),
    }


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, 0.0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure_step(
    manager: AgentLoopManager, hosts: list[Any], batch: DataProto
) -> dict[str, Any]:
    """One timed ``generate_sequences``: rates, latencies, CPU and memory per role."""
    before = snapshot(manager, hosts, reset=True)
    calls0 = sum(c["calls"] for c in ray.get([h.counters.remote() for h in hosts]))
    start = time.perf_counter()
    out = manager.generate_sequences(batch)
    wall = time.perf_counter() - start
    after = snapshot(manager, hosts, reset=True)
    calls = sum(c["calls"] for c in ray.get([h.counters.remote() for h in hosts])) - calls0
    statuses = out.non_tensor_batch["status"].tolist()
    row: dict[str, Any] = {
        "trajectories": len(batch), "calls": calls, "wall_s": wall,
        "samples_per_s": len(batch) / wall, "calls_per_s": calls / wall,
        "ok": sum(s in ("stop", "length") for s in statuses),
    }
    acquire = [x for w in after["workers"] for x in w["acquire_s"]]
    call = [x for w in after["workers"] for x in w["call_s"]]
    row.update(acquire_p50_ms=1e3 * pct(acquire, 0.5), acquire_p99_ms=1e3 * pct(acquire, 0.99),
               call_p50_ms=1e3 * pct(call, 0.5), call_p99_ms=1e3 * pct(call, 0.99))
    for role in ROLES:
        cpu = [a["cpu_s"] - b["cpu_s"] for a, b in zip(after[role], before[role], strict=True)]
        row[f"{role}_cpu_us_per_call"] = 1e6 * sum(cpu) / max(calls, 1)
        row[f"{role}_busiest_core"] = max(cpu, default=0.0) / wall
        row[f"{role}_rss_mb"] = sum(a["rss"] for a in after[role]) / 2**20
    return row


def run_setting(
    args: argparse.Namespace, node_ids: list[str], servers: int, routing: str
) -> list[dict[str, Any]]:
    """Start hosts and a manager over ``servers`` virtual servers routed the ``routing`` way
    (``rollout.server.balancer``: ``shared``, the balancer actor, or ``local``, each worker's own);
    warm up, then time the steps."""
    cfg = fleet_config(args, routing)
    replies = tool_replies(cfg) if args.agent == "tool_agent" else {}
    hosts = start_fleet_hosts(
        args.hosts, node_ids, latency=args.latency, token_rate=args.token_rate, tokens=args.tokens,
        **replies,
    )
    group = ServerGroup(
        handles=virtual_servers(hosts, servers), placement_group=None, device="cpu", info=[]
    )
    manager = AgentLoopManager(cfg, servers=group)
    rows = []
    try:
        manager.generate_sequences(make_batch(args, min(args.trajectories, 500)))
        batch = make_batch(args, args.trajectories)
        for step in range(args.steps):
            row = {"servers": servers, "routing": routing, "agent": args.agent, "step": step,
                   **measure_step(manager, hosts, batch)}
            rows.append(row)
            print_row(row)
    finally:
        manager.shutdown()
    return rows


def print_row(row: dict[str, Any]) -> None:
    """One setting's line, then its per-role line."""
    print(
        f"servers={row['servers']:5d}  {row['routing']:6s}  "
        f"trajectories={row['trajectories']}  calls={row['calls']}  "
        f"{row['wall_s']:.1f} s  {row['samples_per_s']:.0f} samples/s  "
        f"{row['calls_per_s']:.0f} calls/s  balancer wait p50 {row['acquire_p50_ms']:.1f} ms "
        f"p99 {row['acquire_p99_ms']:.1f} ms  call p50 {row['call_p50_ms']:.1f} ms "
        f"p99 {row['call_p99_ms']:.1f} ms  ok={row['ok']}", flush=True,
    )
    print("    " + "  ".join(
        f"{role}: {row[f'{role}_cpu_us_per_call']:.0f} µs/call, busiest "
        f"{row[f'{role}_busiest_core']:.2f} core, {row[f'{role}_rss_mb']:.0f} MiB"
        for role in ROLES
    ), flush=True)


def saturation(rows: list[dict[str, Any]]) -> None:
    """Which single-process role caps the calls/s first, from the largest setting's costs (the
    shipped routing's row)."""
    shipped = [r for r in rows if r["routing"] == "shared"] or rows
    last = shipped[-1]
    print(f"ceilings from servers={last['servers']} ({last['routing']}):")
    for role in ("driver", "balancer"):
        cost = last[f"{role}_cpu_us_per_call"]
        cap = 1e6 / cost if cost else float("inf")
        print(f"{role}: {cost:.1f} µs CPU per call -> at most {cap:,.0f} calls/s on one core")
    for role in ("workers", "hosts"):
        cost = last[f"{role}_cpu_us_per_call"]
        print(f"{role}: {cost:.1f} µs CPU per call in all -> {1e6 / max(cost, 1e-9):,.0f} calls/s "
              "per core they are given (they scale out)")


def placement_peak(servers: int, trajectories: int, workers: int) -> tuple[int, int]:
    """The busiest server's in-flight count once every trajectory of a step is placed: one shared
    balancer, and ``workers`` worker-local ones each given every ``workers``-th trajectory (the
    real ``Balancer``, no Ray; fake servers hide this, their latency ignores load)."""
    shared = make_balancer(servers, max_cache_size=2 * trajectories)
    local = [make_balancer(servers, max_cache_size=2 * trajectories) for _ in range(workers)]
    load = [0] * servers
    for t in range(trajectories):
        shared.acquire(f"t{t}")
        load[local[t % workers].acquire(f"t{t}")] += 1
    return max(shared.stats()["in_flight"]), max(load)


def print_placement(args: argparse.Namespace) -> None:
    """``--placement``: the busiest server, shared vs worker-local, per server count."""
    for servers in [int(s) for s in args.servers.split(",")]:
        shared, local = placement_peak(servers, args.trajectories, args.workers)
        print(f"servers={servers:5d}  trajectories={args.trajectories}  workers={args.workers}  "
              f"mean {args.trajectories / servers:.1f}  busiest server: shared {shared}  "
              f"local {local}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default="64,256,1024")
    parser.add_argument("--trajectories", type=int, default=10000)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=4, help="tokens per reply")
    parser.add_argument("--latency", type=float, default=0.01, help="seconds before the reply")
    parser.add_argument("--token-rate", type=float, default=1000.0, help="tokens/s of a reply")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--cpus-per-node", type=int, default=8)
    parser.add_argument("--hosts", type=int, default=8, help="FleetServer actor processes")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--routing", default="shared",
                        help="comma list of rollout.server.balancer values: shared (the "
                        "balancer actor, the default) and/or local (worker-local routers); "
                        "alternated per setting")
    parser.add_argument("--agent", default="fleet_agent", choices=["fleet_agent", "tool_agent"])
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--placement", action="store_true",
                        help="only print the busiest server's load after placing a step's "
                        "trajectories, shared vs worker-local balancers (no Ray)")
    args = parser.parse_args()
    if args.placement:
        print_placement(args)
        return

    t0 = time.perf_counter()
    cluster, node_ids = start_cluster(args.nodes, args.cpus_per_node)
    print(f"cluster of {len(node_ids)} nodes up in {time.perf_counter() - t0:.1f} s", flush=True)
    rows: list[dict[str, Any]] = []
    try:
        for servers in [int(s) for s in args.servers.split(",")]:
            for routing in args.routing.split(","):
                rows += run_setting(args, node_ids, servers, routing)
    finally:
        ray.shutdown()
        cluster.shutdown()
    saturation(rows)
    median = statistics.median(r["calls_per_s"] for r in rows)
    print(f"calls/s over the settings: median {median:.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
