"""A simulated 4-node Ray cluster for the multi-node tests; run by ``test_multinode.py`` in its own
process.

Usage: ``python tests/integration/multinode_cluster.py REPORT.json MODEL_PATH [--vllm]``.  Builds a
``ray.cluster_utils.Cluster`` of four nodes (two CPUs each, custom resource ``node_<i>``) and:

1. ``spread``: a manager with four standalone servers (``server.placement_strategy: SPREAD``) and
   four agent-loop workers rolls out a batch; which node every server and worker landed on;
2. ``node_removed``: the same manager with slow servers; mid-batch a node holding a server and a
   worker is removed (``cluster.remove_node``): the rows, their statuses and order, the fault
   counts, what ``recover`` reports and a second batch;
3. ``vllm`` (with ``--vllm``): the tiny model on vLLM CPU, one engine on each of two nodes
   (STRICT_SPREAD), a tool-free batch through them.

Servers of 1 and 2 are :class:`NodeServer` (a ScriptedServer taking VLLMServer's constructor).
Writes what it saw as JSON for the test to check; it asserts nothing itself.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any


def _node_of(actor: Any) -> str:
    import ray

    return ray.get(
        actor.__ray_call__.remote(lambda _self: ray.get_runtime_context().get_node_id()), timeout=60
    )


def _try_node_of(actor: Any) -> str:
    try:
        return _node_of(actor)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}"


def main(report_path: str, model_path: str, with_vllm: bool) -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from omegaconf import OmegaConf
    from ray.cluster_utils import Cluster

    import agentloop.cluster.placement as placement
    from agentloop.batch.data import rows_to_batch
    from agentloop.config import default_config
    from agentloop.rollout.manager import AgentLoopManager
    from agentloop.testing import ScriptedServer

    delay = {"s": 0.0}

    class NodeServer(ScriptedServer):
        """ScriptedServer with VLLMServer's constructor and ``start``; replies after ``delay["s"]``
        seconds (the value when the actor was created)."""

        def __init__(self, sections: Any, server_index: int = 0, wait: float = delay["s"]) -> None:
            super().__init__(name=f"s{server_index}", delay=wait)

        async def start(self) -> dict[str, Any]:
            return {"platform": "scripted"}

    def slow_servers() -> type:
        """NodeServer replying after ``delay["s"]`` seconds (the value now)."""
        wait = delay["s"]

        class Slow(NodeServer):
            def __init__(self, sections: Any, server_index: int = 0) -> None:
                super().__init__(sections, server_index, wait)

        return Slow

    t0 = time.monotonic()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"node_0": 1}, "include_dashboard": False},
    )
    nodes = {"node_0": cluster.head_node}
    for i in range(1, 4):
        nodes[f"node_{i}"] = cluster.add_node(num_cpus=2, resources={f"node_{i}": 1})
    ray.init(address=cluster.address, logging_level="ERROR")
    cluster.wait_for_nodes()
    ids = {name: node.node_id for name, node in nodes.items()}
    report: dict[str, Any] = {"cluster_up_s": time.monotonic() - t0, "nodes": ids}

    def config(**rollout: Any) -> Any:
        cfg = default_config()
        cfg.actor_rollout_ref.model.path = model_path
        cfg.data.max_response_length = 16
        for key, value in {
            "agent.num_workers": 4, "server.device": "cpu", "server.num_servers": 4,
            "server.placement_strategy": "SPREAD", "free_cache_engine": False, **rollout,
        }.items():
            OmegaConf.update(cfg.actor_rollout_ref.rollout, key, value)
        return cfg

    def rows(n: int, tag: str) -> Any:
        return rows_to_batch(
            [{"prompt": [{"role": "user", "content": f"{tag} {i}"}]} for i in range(n)]
        )

    def summary(out: Any) -> dict[str, Any]:
        nt = out.non_tensor_batch
        return {
            "rows": len(out),
            "statuses": nt["status"].tolist(),
            "index": nt["index"].tolist(),
            "errors": [e for e in nt["error"].tolist() if e],
            "faults": {
                k.rsplit("/", 1)[-1]: v
                for k, v in out.meta_info["timing"].items()
                if "/faults/" in k
            },
        }

    try:
        delay["s"] = 2.0
        # stands in for VLLMServer, restarts included
        placement.SERVER_CLASSES["vllm"] = slow_servers()
        manager = AgentLoopManager(config())
        try:
            servers, workers = list(manager.server_handles), list(manager.agent_loop_workers)
            report["spread"] = {"server_nodes": [_node_of(h) for h in servers],
                                "worker_nodes": [_node_of(h) for h in workers]}
            first = manager.generate_sequences(rows(8, "warm"))
            report["spread"].update(summary(first))
            report["spread"]["calls"] = [
                len(ray.get(h.__ray_call__.remote(lambda s: s.calls))) for h in servers
            ]

            # a node (not the head: the driver is attached to it) holding a server and a worker
            server_nodes = report["spread"]["server_nodes"]
            victim = next(
                name
                for name, node_id in ids.items()
                if name != "node_0"
                and node_id in server_nodes
                and node_id in report["spread"]["worker_nodes"]
            )
            result: dict[str, Any] = {}

            def run() -> None:
                try:
                    result["out"] = manager.generate_sequences(rows(32, "main"))
                except Exception as e:  # noqa: BLE001 - reported to the test
                    result["error"] = f"{type(e).__name__}: {e}"

            thread = threading.Thread(target=run)
            started = time.monotonic()
            thread.start()
            time.sleep(0.7)
            cluster.remove_node(nodes[victim])
            thread.join(timeout=300)
            removed: dict[str, Any] = {
                "victim": victim, "victim_id": ids[victim], "batch_s": time.monotonic() - started,
                "error": result.get("error"),
            }
            if "out" in result:
                removed.update(summary(result["out"]))
            waited = time.monotonic()
            # the lost server's bundle is re-placed on another node, then it restarts there
            for _ in range(24):
                removed["recover"] = state = manager.recover(timeout=5)
                if not (
                    state["servers_down"]
                    or state["servers_restarting"]
                    or state["workers_starting"]
                ):
                    break
            removed["recover_s"] = time.monotonic() - waited
            again = manager.generate_sequences(rows(8, "after"))
            removed["after"] = summary(again)
            removed["server_nodes_after"] = [_try_node_of(h) for h in manager.server_handles]
            report["node_removed"] = removed
        finally:
            manager.shutdown()
        report["scripted_s"] = time.monotonic() - t0

        if with_vllm:
            del placement.SERVER_CLASSES["vllm"]  # the real VLLMServer again
            t1 = time.monotonic()
            cfg = config(
                **{
                    "server.num_servers": 2, "server.placement_strategy": "STRICT_SPREAD",
                    "agent.num_workers": 2, "dtype": "float32", "enforce_eager": True,
                    "max_num_seqs": 8, "calculate_log_probs": True,
                }
            )
            cfg.data.max_prompt_length = 64
            manager = AgentLoopManager(cfg)
            try:
                out = manager.generate_sequences(rows(6, "Tell me about the sea, please:"))
                report["vllm"] = {"server_nodes": [_node_of(h) for h in manager.server_handles],
                                  "platforms": [i.get("platform") for i in manager.servers.info],
                                  **summary(out),
                                  "response_tokens": int(out.batch["response_mask"].sum()),
                                  "logprobs_finite": bool(out.batch["rollout_log_probs"][
                                      out.batch["response_mask"].bool()].isfinite().all()),
                                  "engine_busy_s": manager.engine_busy_seconds()}
            finally:
                manager.shutdown()
            report["vllm_s"] = time.monotonic() - t1
        report["total_s"] = time.monotonic() - t0
    finally:
        with open(report_path, "w") as f:
            json.dump(report, f, default=str)
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--vllm" in sys.argv[3:])
