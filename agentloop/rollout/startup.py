"""Starting an AgentLoopManager's actors: its server group, the shared balancer, its workers.

:func:`open_servers` picks where the servers come from (shared, injected, colocated beside the
trainer, or standalone); :func:`shared_balancer` starts the one balancer actor when there is
something to balance; :func:`spawn_worker` starts one AgentLoopWorker actor pinned to a node,
round-robin over the nodes alive now.  Spec: docs/concepts.md#placement.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from agentloop.cluster.colocated import start_colocated_servers
from agentloop.cluster.placement import ServerGroup, start_standalone_servers
from agentloop.config import AgentLoopConfig, WorkerSections
from agentloop.loops.base import ResolvedAgentLoop
from agentloop.rollout.worker import AgentLoopWorker
from agentloop.routing.balancer_actor import create_global_balancer


def open_servers(
    config: AgentLoopConfig, worker_group: Any, rollout_resource_pool: Any, llm_client: Any,
    servers: ServerGroup | None,
) -> ServerGroup:
    """The manager's servers: ``llm_client``'s (shared, neither started nor stopped here), else
    ``servers`` as given, else one per rollout replica beside ``worker_group`` (colocated), else
    standalone servers in their own placement group."""
    if llm_client is not None:
        return ServerGroup(list(llm_client.server_handles), None, "shared", [], "shared")
    if servers is not None:
        return servers
    if worker_group is not None:
        return start_colocated_servers(config, worker_group, rollout_resource_pool)
    return start_standalone_servers(config)


def shared_balancer(num_servers: int, max_cache_size: int) -> Any:
    """The GlobalBalancer actor every worker's router shares, or None for one server (nothing to
    balance: workers then route locally and skip the actor hop)."""
    if num_servers <= 1:
        return None
    return create_global_balancer(num_servers, max_cache_size=max_cache_size)


def alive_nodes() -> list[str]:
    """The ids of the Ray nodes alive now, sorted."""
    return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])


def spawn_worker(
    config: AgentLoopConfig, server_handles: list[Any], balancer: Any,
    registry: dict[str, ResolvedAgentLoop], *, index: int, worker_id: str,
    known_nodes: list[str],
) -> Any:
    """Start worker ``index`` as an AgentLoopWorker actor (owner id ``worker_id``) on node
    ``index`` mod the nodes alive now (``known_nodes`` if none answers); returns its handle.

    A hard affinity: Ray's soft one let several workers pile onto one node of a 4-node cluster
    (tests/integration/test_multinode); a replacement so avoids a node that is gone.
    """
    cls: Any = ray.remote(AgentLoopWorker)
    nodes = alive_nodes() or known_nodes
    return cls.options(
        num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[index % len(nodes)], soft=False),
        max_concurrency=10000,
    ).remote(
        WorkerSections.of(config), config.root, list(server_handles), balancer, registry,
        worker_id=worker_id,
    )
