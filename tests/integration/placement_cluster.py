"""Colocated placement on a simulated two-node Ray cluster; run by ``test_placement.py`` in its own
process.

Usage: ``python tests/integration/placement_cluster.py REPORT.json MODEL_PATH``.  Builds a
``ray.cluster_utils.Cluster`` with nodes ``node_a`` / ``node_b`` (one CPU each), a fake trainer (one
one-CPU actor per node, each filling its placement-group bundle) and places rollout servers next to
it three ways (declared bundles through a manager, rolling out; nodes only; verl's resource pool);
servers are :class:`NodeServer` (a ScriptedServer taking VLLMServer's constructor).  Writes what it
saw as JSON for the test to check; it asserts nothing itself.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any


def _node_of(actor: Any) -> str:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda _self: ray.get_runtime_context().get_node_id()))


def _pg_of(actor: Any) -> str | None:
    import ray

    return ray.get(
        actor.__ray_call__.remote(lambda _self: ray.get_runtime_context().get_placement_group_id())
    )


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main(report_path: str, model_path: str) -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from omegaconf import OmegaConf
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    import agentloop.cluster.placement as placement
    from agentloop.batch.data import rows_to_batch
    from agentloop.cluster.colocated import TrainerWorkers, start_colocated_servers
    from agentloop.config import default_config, resolve_config
    from agentloop.rollout.manager import AgentLoopManager
    from agentloop.testing import ScriptedServer

    class NodeServer(ScriptedServer):
        """ScriptedServer with VLLMServer's constructor and ``start``; server 1 cannot sleep (as
        a CPU engine)."""

        def __init__(self, sections: Any, server_index: int = 0) -> None:
            super().__init__(name=f"s{server_index}")
            self.supports_sleep = server_index != 1

        async def start(self) -> dict[str, Any]:
            return {"platform": "scripted", "env_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}

    # stands in for VLLMServer in every start_*_servers
    placement.SERVER_CLASSES["vllm"] = NodeServer

    t0 = time.monotonic()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"node_a": 1}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=1, resources={"node_b": 1})
    ray.init(address=cluster.address, logging_level="ERROR")
    report: dict[str, Any] = {"cluster_up_s": time.monotonic() - t0}
    records = _Records()
    logging.getLogger("agentloop").addHandler(records)
    logging.getLogger("agentloop").setLevel(logging.INFO)

    @ray.remote(num_cpus=1)
    class TrainerWorker:
        def rank(self) -> int:
            return 0

    def config(**rollout: Any) -> Any:
        cfg = default_config()
        cfg.actor_rollout_ref.model.path = model_path
        cfg.data.max_response_length = 8
        for key, value in {"agent.num_workers": 1, "server.device": "cpu", **rollout}.items():
            OmegaConf.update(cfg.actor_rollout_ref.rollout, key, value)
        return cfg

    def nodes(handles: list[Any]) -> list[str]:
        return [_node_of(h) for h in handles]

    try:
        # 1. one placement group, one bundle per node; rank 0 sits in bundle 1 (bundle order != rank
        # order).
        pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD")
        ray.get(pg.ready())
        trainer = [
            TrainerWorker.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, b)
            ).remote()
            for b in (1, 0)
        ]
        manager = AgentLoopManager(config(), TrainerWorkers(trainer, pg, [1, 0]))
        try:
            rows = [{"prompt": [{"role": "user", "content": f"hi {i}"}]} for i in range(4)]
            out = manager.generate_sequences(rows_to_batch(rows))
            manager.sleep()  # already asleep (free_cache_engine): nothing happens
            counts = ray.get(
                [h.__ray_call__.remote(lambda s: dict(s.counts)) for h in manager.server_handles]
            )
            report["bundled"] = {
                "trainer_nodes": nodes(trainer),
                "server_nodes": nodes(manager.server_handles),
                "server_pgs": [_pg_of(h) for h in manager.server_handles],
                "pg": pg.id.hex(),
                "info": manager.servers.info,
                "placement": manager.servers.placement,
                "rows": len(out),
                "statuses": sorted(set(out.non_tensor_batch["status"].tolist())),
                "calls": [
                    len(ray.get(h.__ray_call__.remote(lambda s: s.calls)))
                    for h in manager.server_handles
                ],
                "can_sleep": manager.can_sleep,
                "sleeping": manager.sleeping,
                "counts": counts,
                "no_op_logs": [m for m in records.messages if "cannot sleep" in m],
            }
            manager.wake_up()
            report["bundled"]["sleeping_after_wake_up"] = manager.sleeping
        finally:
            manager.shutdown()
        report["bundled"]["trainer_alive_after_shutdown"] = ray.get(trainer[0].rank.remote()) == 0
        report["bundled_s"] = time.monotonic() - t0

        # 2. nodes only (no bundles declared): the same workers, servers get hard node affinity.
        cfg = resolve_config(config())
        servers = start_colocated_servers(cfg, TrainerWorkers(trainer))
        report["by_node"] = {
            "trainer_nodes": nodes(trainer), "server_nodes": nodes(servers.handles),
            "info": servers.info,
        }
        placement.stop_servers(servers)
        try:  # one server for two workers on two nodes: refused, nothing started
            start_colocated_servers(
                resolve_config(config(**{"server.num_servers": 1})), TrainerWorkers(trainer)
            )
            report["spanning_error"] = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            report["spanning_error"] = f"{type(e).__name__}: {e}"
        ray.util.remove_placement_group(pg)
        for h in trainer:
            ray.kill(h)

        # 3. verl's shape: RayWorkerGroup.workers / world_size / resource_pool (pgs, store: one
        # group per node).
        pools = [placement_group([{"CPU": 1, resource: 0.1}]) for resource in ("node_b", "node_a")]
        ray.get([p.ready() for p in pools])

        class VerlPool:
            pgs = pools
            store = [1, 1]

        class VerlWorkerGroup:
            def __init__(self) -> None:
                self.workers = [
                    TrainerWorker.options(
                        scheduling_strategy=PlacementGroupSchedulingStrategy(p, 0)
                    ).remote()
                    for p in pools
                ]
                self.world_size = 2
                self.resource_pool = VerlPool()

        group = VerlWorkerGroup()
        servers = start_colocated_servers(cfg, group)
        report["verl"] = {
            "trainer_nodes": nodes(group.workers), "server_nodes": nodes(servers.handles),
            "server_pgs": [_pg_of(h) for h in servers.handles], "pgs": [p.id.hex() for p in pools],
            "info": servers.info,
        }
        placement.stop_servers(servers)
        report["total_s"] = time.monotonic() - t0
    finally:
        with open(report_path, "w") as f:
            json.dump(report, f, default=str)
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
