"""Colocated placement: rollout servers beside the trainer's workers.

The cluster test runs ``placement_cluster.py`` in its own process (a ``ray.cluster_utils.Cluster``
needs its own ``ray.init``, which must not meet the Ray sessions of the other integration modules);
the other tests check the worker → replica → slot rules without Ray.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from agentloop.cluster.colocated import (
    TrainerWorkerGroup,
    TrainerWorkers,
    WorkerLocation,
    colocated_slots,
    group_replicas,
    locate_workers,
    replica_size,
)
from agentloop.config import EngineConfig, ServerConfig
from agentloop.errors import ConfigError

SCRIPT = Path(__file__).with_name("placement_cluster.py")


@pytest.mark.integration
def test_servers_land_beside_their_trainer_workers_on_a_two_node_cluster(tmp_path):
    """Three ways to say where the trainer runs (bundle list, nodes only, verl's resource pool):
    each server is on its worker's node (in its bundle when one is declared), rollout runs end to
    end through the manager, sleep state is public and the no-op is logged once, and shutdown leaves
    the trainer's workers alone."""
    from agentloop.testing.tiny_model import ensure_tiny_model

    report_path = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(report_path), str(ensure_tiny_model())],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(report_path.read_text())

    bundled = report["bundled"]
    assert bundled["server_nodes"] == bundled["trainer_nodes"]
    assert len(set(bundled["trainer_nodes"])) == 2
    assert bundled["server_pgs"] == [bundled["pg"]] * 2  # inside the trainer's placement group
    assert [i["bundle_index"] for i in bundled["info"]] == [1, 0]  # rank 0 sits in bundle 1
    assert [i["trainer_ranks"] for i in bundled["info"]] == [[0], [1]]
    assert bundled["placement"] == "colocated"
    assert bundled["rows"] == 4 and bundled["statuses"] == ["stop"] and sum(bundled["calls"]) == 4
    # server 0 can sleep, server 1 cannot: free_cache_engine puts 0 to sleep after start, wakes it
    # for the batch
    # and puts it back after; 1 is never called; the no-op is logged once for the three sleep()
    # calls.
    assert (
        not bundled["can_sleep"] and bundled["sleeping"] and not bundled["sleeping_after_wake_up"]
    )
    assert [(c["sleep"], c["wake_up"]) for c in bundled["counts"]] == [(2, 1), (0, 0)]
    assert (
        len(bundled["no_op_logs"]) == 1
        and "1 of 2 servers cannot sleep" in bundled["no_op_logs"][0]
    )
    assert bundled["trainer_alive_after_shutdown"]

    by_node = report["by_node"]
    assert by_node["server_nodes"] == by_node["trainer_nodes"] == bundled["trainer_nodes"]
    assert [i["bundle_index"] for i in by_node["info"]] == [None, None]
    assert "spans 2 nodes" in report["spanning_error"]

    verl = report["verl"]
    assert verl["server_nodes"] == verl["trainer_nodes"] and len(set(verl["trainer_nodes"])) == 2
    # rank r's server in the pool's group that rank r reported
    assert verl["server_pgs"] == verl["pgs"]
    assert [i["bundle_index"] for i in verl["info"]] == [0, 0]


def _rollout(**kw):
    """The (engine, server) sections replica_size reads, from a rollout slice."""
    base = {"tensor_model_parallel_size": 1, "server": {"num_servers": None}}
    rollout = OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(kw))
    return EngineConfig.from_rollout(rollout), ServerConfig.from_rollout(rollout)


_NODE = {"a": "a" * 56, "b": "b" * 56}  # node ids are 28-byte hex strings


def _locations(
    nodes: list[str], gpus: list[list[str]] | None = None, bundles: bool = False
) -> list[WorkerLocation]:
    pg = object()
    return [
        WorkerLocation(
            rank=r, node_id=_NODE[n], gpu_ids=tuple(gpus[r]) if gpus else (),
            placement_group_id=None, bundle=(pg, r) if bundles else None,
        )  # type: ignore[arg-type]
        for r, n in enumerate(nodes)
    ]


def test_replica_size_follows_tp_on_gpus_and_num_servers_on_cpu():
    assert replica_size(*_rollout(tensor_model_parallel_size=2), "cuda", 8) == 2
    assert replica_size(*_rollout(), "cpu", 4) == 1
    assert replica_size(*_rollout(server={"num_servers": 2}), "cpu", 4) == 2
    with pytest.raises(ConfigError, match="must divide the trainer's 4 workers"):
        replica_size(*_rollout(server={"num_servers": 3}), "cpu", 4)
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=4 must divide"):
        replica_size(*_rollout(tensor_model_parallel_size=4), "cuda", 6)
    with pytest.raises(ConfigError, match="leave num_servers null"):
        replica_size(*_rollout(tensor_model_parallel_size=2, server={"num_servers": 1}), "cuda", 8)


def test_replicas_are_consecutive_ranks_on_one_node():
    replicas = group_replicas(_locations(["a", "a", "b", "b"]), 2)
    assert [[w.rank for w in r] for r in replicas] == [[0, 1], [2, 3]]
    with pytest.raises(ConfigError, match="replica 1 .*ranks 2-3.* spans 2 nodes"):
        group_replicas(_locations(["a", "a", "a", "b"]), 2)


def test_gpu_slots_see_their_replicas_gpus_and_reserve_nothing():
    locations = _locations(["a"] * 4, gpus=[["0"], ["1"], ["2"], ["3"]], bundles=True)
    slots = colocated_slots(group_replicas(locations, 2), "cuda", tp=2)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in slots] == ["0,1", "2,3"]
    assert all(s.env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1" for s in slots)
    assert all(s.num_cpus == 0 and s.num_gpus == 0 for s in slots)
    assert all(isinstance(s.scheduling_strategy, PlacementGroupSchedulingStrategy) for s in slots)
    assert [s.scheduling_strategy.placement_group_bundle_index for s in slots] == [0, 2]
    two_on_one = _locations(["a", "a"], gpus=[["0"], ["0"]])
    with pytest.raises(ConfigError, match="needs 2 distinct GPUs"):
        colocated_slots(group_replicas(two_on_one, 2), "cuda", tp=2)


def test_cpu_slots_without_bundles_pin_to_the_node_and_split_its_cores():
    slots = colocated_slots(group_replicas(_locations(["a", "b", "a"]), 1), "cpu", tp=1)
    assert all(isinstance(s.scheduling_strategy, NodeAffinitySchedulingStrategy) for s in slots)
    assert [s.scheduling_strategy.node_id for s in slots] == [_NODE["a"], _NODE["b"], _NODE["a"]]
    assert all(not s.scheduling_strategy.soft for s in slots)
    assert [s.facts["trainer_ranks"] for s in slots] == [[0], [1], [2]]
    binds = [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in slots]
    # two engines on node a do not share their cores
    assert binds[0] != binds[2] or binds[0] == "nobind"


def test_worker_group_shape_is_checked():
    assert isinstance(TrainerWorkers([object(), object()]), TrainerWorkerGroup)
    assert TrainerWorkers([object()] * 3).world_size == 3
    with pytest.raises(ConfigError, match="has no `workers` / `world_size`"):
        locate_workers([object()])
