"""The one way to build a router: every worker and gateway routes with the same settings.

:func:`build_router` turns the typed :class:`agentloop.config.RouterConfig` (``cfg.router`` of an
:class:`agentloop.config.AgentLoopConfig`) into an :class:`AsyncLLMServerManager`: the sticky-cache
size, batched server calls, failover budget, priority policy, partial rollouts and restart of
preempted generations all come from that one config, so a gateway session routes exactly like a
``tool_agent`` sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ray.actor import ActorHandle

from agentloop.config.schema import RouterConfig
from agentloop.routing.manager import AsyncLLMServerManager
from agentloop.routing.strategies import Balancer
from agentloop.routing.tail import make_priority


def build_router(
    router_cfg: RouterConfig, server_handles: Sequence[Any],
    balancer: Balancer | ActorHandle | None, *, owner: str | None = None,
) -> AsyncLLMServerManager:
    """An :class:`AsyncLLMServerManager` over ``server_handles`` with the settings of
    ``router_cfg``.

    Args:
        router_cfg: the router section (``cfg.router``; or ``RouterConfig.from_root(root)``).
        server_handles: the server actors (or local servers) to route to.
        balancer: the shared balancer (actor or local); None builds a local one of
        ``max_cache_size``. owner: the caller's id (a worker or gateway), so its in-flight slots can
        be released if it dies.

    Raises:
        RoutingError: ``server_handles`` is empty.
        ConfigError: ``router_cfg.priority`` names no policy.
    """
    return AsyncLLMServerManager(
        server_handles, balancer, max_cache_size=router_cfg.max_cache_size,
        batch_calls=router_cfg.batch_calls, owner=owner, max_failovers=router_cfg.max_failovers,
        partial_rollout=router_cfg.partial_rollout, restart_preempted=router_cfg.restart_preempted,
        priority=make_priority(router_cfg.priority), routing=router_cfg.routing,
    )
