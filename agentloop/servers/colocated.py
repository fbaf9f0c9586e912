"""The documented import path of :mod:`agentloop.cluster.colocated` (re-exports only)."""

from agentloop.cluster.colocated import (  # noqa: F401
    BundledWorkerGroup,
    ResourcePoolLike,
    TrainerWorkerGroup,
    TrainerWorkers,
    WorkerLocation,
    colocated_slots,
    group_replicas,
    locate_workers,
    replica_size,
    start_colocated_servers,
)

__all__ = [
    "BundledWorkerGroup", "ResourcePoolLike", "TrainerWorkerGroup", "TrainerWorkers",
    "WorkerLocation", "colocated_slots", "group_replicas", "locate_workers", "replica_size",
    "start_colocated_servers",
]
