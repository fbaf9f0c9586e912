"""Colocated placement: one rollout server per replica of the trainer's workers, beside those
workers.

``start_colocated_servers(cfg, worker_group, resource_pool=None)`` asks every worker once where it
runs, groups consecutive ranks into replicas (``tensor_model_parallel_size`` ranks on GPUs; on CPU
``world_size // server.num_servers`` when that is set) and starts one server per replica in the
bundle of its first worker (else on that worker's node). The servers reserve no CPU or GPU of their
own; the returned ``ServerGroup`` kills them on shutdown and leaves the trainer's workers and
bundles alone.

``worker_group`` provides ``workers`` and ``world_size`` (:class:`TrainerWorkerGroup`; verl's
``RayWorkerGroup`` does), and optionally its bundles: :class:`TrainerWorkers` (``placement_group`` +
``bundle_indices``) or a verl resource pool (``worker_group.resource_pool`` or ``resource_pool``).

Raises ``ConfigError`` when the workers cannot be reached or located, when the replica size does not
divide ``world_size`` (or ``num_servers`` contradicts it on GPUs), or when a replica spans nodes.

Spec (placement rules, bundles, ``CUDA_VISIBLE_DEVICES``, sleep): docs/concepts.md#placement.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import ray
import ray.exceptions
from ray.util.placement_group import PlacementGroup, placement_group_table
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from agentloop.cluster.placement import (
    ServerGroup,
    ServerSlot,
    cpu_bind_env,
    detect_device,
    launch_servers,
)
from agentloop.config import AgentLoopConfig, EngineConfig, ServerConfig
from agentloop.errors import ConfigError

logger = logging.getLogger(__name__)

Bundle = tuple[PlacementGroup, int]
"""A placement group and the index of one of its bundles."""


@runtime_checkable
class TrainerWorkerGroup(Protocol):
    """What colocated placement needs from a trainer's worker group (verl's ``RayWorkerGroup``
    has both)."""

    @property
    def workers(self) -> Sequence[Any]:
        """The workers' Ray actor handles, in rank order."""
        ...

    @property
    def world_size(self) -> int:
        """``len(workers)``."""
        ...


@runtime_checkable
class BundledWorkerGroup(TrainerWorkerGroup, Protocol):
    """A worker group that says which bundle each worker runs in (see :class:`TrainerWorkers`)."""

    @property
    def placement_group(self) -> PlacementGroup | Sequence[PlacementGroup] | None:
        """One placement group for all workers, or one per worker; None when unknown."""
        ...

    @property
    def bundle_indices(self) -> Sequence[int] | None:
        """Bundle of worker ``i`` in its placement group; None: ``0..world_size-1``."""
        ...


@runtime_checkable
class ResourcePoolLike(Protocol):
    """verl's ``RayResourcePool``: its placement groups and how many workers each holds."""

    @property
    def pgs(self) -> Sequence[PlacementGroup] | None:
        """The pool's placement groups (None before any worker group was created on it)."""
        ...

    @property
    def store(self) -> Sequence[int]:
        """Workers (bundles) per placement group."""
        ...


@runtime_checkable
class _SubResourcePool(ResourcePoolLike, Protocol):
    """verl's ``SubRayResourcePool``: a slice of a pool starting at a global bundle index."""

    @property
    def start_bundle_index(self) -> int: ...


@runtime_checkable
class _PooledWorkerGroup(Protocol):
    """verl 0.9's ``RayWorkerGroup`` keeps the pool it was created on."""

    @property
    def resource_pool(self) -> Any: ...


@dataclass
class TrainerWorkers:
    """A trainer's workers, for ``AgentLoopManager(config, worker_group=TrainerWorkers(...))``.

    Args:
        workers: the workers' actor handles in rank order.
        placement_group: where they run: one placement group for all, or one per worker; None to
        place
            servers by node only.
        bundle_indices: worker ``i``'s bundle in its placement group; None: ``0..len(workers)-1``.
    """

    workers: list[Any]
    placement_group: PlacementGroup | list[PlacementGroup] | None = None
    bundle_indices: list[int] | None = None

    @property
    def world_size(self) -> int:
        """Number of workers."""
        return len(self.workers)


@dataclass(frozen=True)
class WorkerLocation:
    """Where one trainer worker runs, as it reported it."""

    rank: int
    node_id: str
    gpu_ids: tuple[str, ...]
    placement_group_id: str | None
    bundle: Bundle | None
    """Its bundle, when the worker group declares it and Ray places that bundle on the worker's
    node."""


def locate_workers(
    worker_group: Any, resource_pool: Any = None, timeout: float = 120.0
) -> list[WorkerLocation]:
    """Ask every worker of ``worker_group`` where it runs and attach its bundle where one is
    declared."""
    if not isinstance(worker_group, TrainerWorkerGroup):
        raise ConfigError(
            f"worker_group: got {type(worker_group).__name__}, which has no `workers` / "
            f"`world_size`; pass verl's "
            "RayWorkerGroup or agentloop.cluster.colocated.TrainerWorkers(workers=[...actor "
            "handles...])"
        )
    workers = list(worker_group.workers)
    if not workers or len(workers) != int(worker_group.world_size):
        raise ConfigError(
            f"worker_group: world_size={worker_group.world_size} but {len(workers)} workers"
        )

    def report_location(_actor: Any) -> tuple[str, list[str], str | None]:
        """Runs inside a trainer worker (sent by value: the worker need not import agentloop)."""
        context = ray.get_runtime_context()
        gpus = [str(g) for g in context.get_accelerator_ids().get("GPU", [])]
        if not gpus:
            gpus = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
        return context.get_node_id(), gpus, context.get_placement_group_id()

    try:
        reports = ray.get(
            [w.__ray_call__.remote(report_location) for w in workers], timeout=timeout
        )
    except ray.exceptions.GetTimeoutError as e:
        raise ConfigError(
            f"worker_group: the trainer workers did not say where they run "
            f"within {timeout:.0f} s "
            "(busy with a long call?); create the AgentLoopManager while they "
            "are idle"
        ) from e
    except ray.exceptions.RayError as e:
        raise ConfigError(f"worker_group: could not reach the trainer workers: {e}") from e
    bundles = _declared_bundles(worker_group, resource_pool, [pg for _, _, pg in reports])
    return [
        WorkerLocation(rank, node, tuple(gpus), pg_id, _checked(bundle, node, rank))
        for rank, ((node, gpus, pg_id), bundle) in enumerate(zip(reports, bundles, strict=True))
    ]


def _declared_bundles(
    worker_group: Any, pool: Any, pg_ids: list[str | None]
) -> list[Bundle | None]:
    n = len(pg_ids)
    if isinstance(worker_group, BundledWorkerGroup) and worker_group.placement_group is not None:
        declared = worker_group.placement_group
        groups = list(declared) if isinstance(declared, Sequence) else [declared] * n
        indices = (
            list(range(n))
            if worker_group.bundle_indices is None
            else list(worker_group.bundle_indices)
        )
        if len(groups) != n or len(indices) != n:
            raise ConfigError(f"worker_group: {n} workers but {len(groups)} placement groups and "
                              f"{len(indices)} bundle_indices; give one of each per worker")
        return list(zip(groups, (int(i) for i in indices), strict=True))
    if pool is None and isinstance(worker_group, _PooledWorkerGroup):
        pool = worker_group.resource_pool
    if isinstance(pool, ResourcePoolLike) and pool.pgs:
        by_id = {pg.id.hex(): pg for pg in pool.pgs}
        per_group = int(pool.store[0])
        start = int(pool.start_bundle_index) if isinstance(pool, _SubResourcePool) else 0
        return [(by_id[pg_id], (start + rank) % per_group) if pg_id in by_id else None
                for rank, pg_id in enumerate(pg_ids)]
    return [None] * n


def _checked(bundle: Bundle | None, node_id: str, rank: int) -> Bundle | None:
    """The bundle if Ray places it on the worker's node; None (placement by node) otherwise."""
    if bundle is None:
        return None
    group, index = bundle
    if not 0 <= index < group.bundle_count:
        raise ConfigError(
            f"worker_group: rank {rank} is said to run in bundle {index} but "
            f"its placement group "
            f"has {group.bundle_count} bundles"
        )
    bundle_node = placement_group_table(group).get("bundles_to_node_id", {}).get(index)
    if bundle_node != node_id:
        logger.warning(
            "trainer rank %d reports node %s but its declared bundle %d is on "
            "%s; its rollout server "
            "is placed by node instead",
            rank,
            node_id,
            index,
            bundle_node,
        )
        return None
    return bundle


def replica_size(engine: EngineConfig, server: ServerConfig, device: str, world_size: int) -> int:
    """Trainer workers per rollout server (docs/concepts.md#placement); ConfigError when it
    cannot divide them."""
    tp = engine.tensor_model_parallel_size
    configured = server.num_servers
    if device == "cpu" and configured:
        n = int(configured)
        if n <= 0 or world_size % n:
            raise ConfigError(
                f"rollout.server.num_servers={n} must divide the trainer's "
                f"{world_size} workers "
                "(colocated placement: one server per equal group of workers)"
            )
        return world_size // n
    if world_size % tp:
        raise ConfigError(
            f"tensor_model_parallel_size={tp} must divide the trainer's "
            f"{world_size} workers "
            "(colocated placement: one server per tensor_model_parallel_size "
            "workers)"
        )
    if configured and int(configured) != world_size // tp:
        raise ConfigError(
            f"rollout.server.num_servers={configured} but colocated placement "
            f"on GPUs puts one server "
            f"on every {tp} (tensor_model_parallel_size) of the trainer's "
            f"{world_size} workers, i.e. "
            f"{world_size // tp}; leave num_servers null"
        )
    return tp


def group_replicas(locations: list[WorkerLocation], size: int) -> list[list[WorkerLocation]]:
    """Consecutive ranks, ``size`` per replica; each replica on one node."""
    replicas = [locations[i : i + size] for i in range(0, len(locations), size)]
    for r, replica in enumerate(replicas):
        nodes = sorted({w.node_id for w in replica})
        if len(nodes) > 1:
            raise ConfigError(
                f"rollout replica {r} (trainer ranks "
                f"{replica[0].rank}-{replica[-1].rank}) spans "
                f"{len(nodes)} nodes; colocated placement needs each replica "
                f"on one node "
                "(tensor_model_parallel_size <= GPUs per node, ranks numbered "
                "node by node)"
            )
    return replicas


def _gpu_env(replica: list[WorkerLocation], tp: int) -> dict[str, str]:
    gpus = list(dict.fromkeys(g for w in replica for g in w.gpu_ids))
    if len(gpus) != tp:
        raise ConfigError(
            f"trainer ranks {[w.rank for w in replica]} hold GPUs {gpus}; a "
            f"tensor-parallel "
            f"replica of size {tp} needs {tp} distinct GPUs (one per worker)"
        )
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(gpus),
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
    }


def colocated_slots(replicas: list[list[WorkerLocation]], device: str, tp: int) -> list[ServerSlot]:
    """One :class:`ServerSlot` per replica (rules 3 and 4)."""
    per_node = Counter(replica[0].node_id for replica in replicas)
    seen: Counter[str] = Counter()
    slots = []
    for replica in replicas:
        first = replica[0]
        if first.bundle is not None:
            group, index = first.bundle
            strategy: Any = PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=index
            )
        else:
            strategy = NodeAffinitySchedulingStrategy(node_id=first.node_id, soft=False)
        env = (
            _gpu_env(replica, tp)
            if device == "cuda"
            else cpu_bind_env(seen[first.node_id], per_node[first.node_id])
        )
        seen[first.node_id] += 1
        facts = {
            "placement": "colocated", "node_id": first.node_id,
            "trainer_ranks": [w.rank for w in replica],
            "bundle_index": None if first.bundle is None else first.bundle[1],
        }
        slots.append(
            ServerSlot(scheduling_strategy=strategy, num_cpus=0, num_gpus=0, env=env, facts=facts)
        )
    return slots


def start_colocated_servers(
    cfg: AgentLoopConfig, worker_group: Any, resource_pool: Any = None
) -> ServerGroup:
    """Start one server per replica of ``worker_group``'s workers, beside them (see the module
    docstring)."""
    device = detect_device(cfg.server.device)
    locations = locate_workers(worker_group, resource_pool)
    size = replica_size(cfg.engine, cfg.server, device, len(locations))
    slots = colocated_slots(
        group_replicas(locations, size), device, cfg.engine.tensor_model_parallel_size
    )
    if device == "cuda" and not cfg.engine.free_cache_engine:
        logger.warning(
            "colocated rollout servers with free_cache_engine=false never "
            "release GPU memory: the "
            "engine keeps gpu_memory_utilization of every trainer GPU during "
            "training steps"
        )
    handles, info = launch_servers(cfg, slots)
    logger.info(
        "colocated %d rollout servers on %d trainer workers (%s)",
        len(handles),
        len(locations),
        ", ".join(
            f"ranks {s.facts['trainer_ranks']} in bundle {s.facts['bundle_index']}" for s in slots
        ),
    )
    return ServerGroup(
        handles=handles, placement_group=None, device=device, info=info, placement="colocated",
        slots=slots, config=cfg,
    )
