"""Routing: strategies (plain Python), the shared balancer actor and the async client."""

from agentloop.routing.manager import AsyncLLMServerManager
from agentloop.routing.strategies import (
    Balancer,
    LeastInFlight,
    RouteContext,
    RoutingStrategy,
    StickySession,
    make_balancer,
)

__all__ = [
    "AsyncLLMServerManager",
    "Balancer",
    "LeastInFlight",
    "RouteContext",
    "RoutingStrategy",
    "StickySession",
    "make_balancer",
]
