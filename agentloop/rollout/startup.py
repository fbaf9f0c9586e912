"""Starting an AgentLoopManager's actors: its server group, the shared balancer, its workers.

:func:`open_servers` picks where the servers come from (shared, injected, colocated beside the
trainer, or standalone); :func:`shared_balancer` starts the one balancer actor when there is
something to balance and ``rollout.server.balancer`` is ``shared`` (``local``: none, each worker's
router balances its own trajectories, its sticky cache sized by :func:`sticky_share`);
:func:`spawn_worker` starts one AgentLoopWorker actor pinned to a node, round-robin over the nodes
alive now.  Spec: docs/concepts.md#placement,
docs/routing.md#worker-local-routing-serverbalancer-local.
"""

from __future__ import annotations

import dataclasses
import math
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


def shared_balancer(
    num_servers: int, max_cache_size: int, mode: str = "shared", routing: str = "sticky"
) -> Any:
    """The GlobalBalancer actor every worker's router shares, or None: for one server (nothing to
    balance) and with ``mode`` ``local`` (``rollout.server.balancer``), workers then route on their
    own and skip the actor hop. ``routing``: ``rollout.server.routing`` (``sticky``, ``prefix``).
    """
    if num_servers <= 1 or mode == "local":
        return None
    return create_global_balancer(num_servers, max_cache_size=max_cache_size, routing=routing)


def sticky_share(entries: int, num_workers: int) -> int:
    """Bindings each worker-local router keeps when the manager wants ``entries`` in all (twice
    the batch): its share, ``ceil(entries / num_workers)``; the batch is dealt out evenly."""
    return math.ceil(max(0, int(entries)) / max(1, int(num_workers)))


def worker_sections(config: AgentLoopConfig, sticky_capacity: int = 0) -> WorkerSections:
    """What a worker is built with: ``config``'s sections, its router's sticky cache raised to
    ``sticky_capacity`` bindings when that is more than ``server.max_cache_size``."""
    sections = WorkerSections.of(config)
    if sticky_capacity <= sections.router.max_cache_size:
        return sections
    router = dataclasses.replace(sections.router, max_cache_size=int(sticky_capacity))
    return dataclasses.replace(sections, router=router)


def alive_nodes() -> list[str]:
    """The ids of the Ray nodes alive now, sorted."""
    return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])


def spawn_worker(
    config: AgentLoopConfig, server_handles: list[Any], balancer: Any,
    registry: dict[str, ResolvedAgentLoop], *, index: int, worker_id: str,
    known_nodes: list[str], sticky_capacity: int = 0, down_servers: tuple[int, ...] = (),
) -> Any:
    """Start worker ``index`` as an AgentLoopWorker actor (owner id ``worker_id``) on node
    ``index`` mod the nodes alive now (``known_nodes`` if none answers); returns its handle.
    ``sticky_capacity``: its router's sticky cache size when larger than
    ``server.max_cache_size``; ``down_servers``: servers out of routing now (both for worker-local
    routing, where a replacement worker has no balancer actor to learn them from).

    A hard affinity: Ray's soft one let several workers pile onto one node of a 4-node cluster
    (tests/integration/test_multinode); a replacement so avoids a node that is gone.
    """
    cls: Any = ray.remote(AgentLoopWorker)
    sections = worker_sections(config, sticky_capacity)
    nodes = alive_nodes() or known_nodes
    return cls.options(
        num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[index % len(nodes)], soft=False),
        max_concurrency=10000,
    ).remote(
        sections, config.root, list(server_handles), balancer, registry,
        worker_id=worker_id, down_servers=tuple(down_servers),
    )
