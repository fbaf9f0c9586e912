"""Routing: strategies (plain Python), the shared balancer actor and the async client."""

from agentloop.routing.balancer_actor import BalancerActor, RemoteBalancer, create_global_balancer
from agentloop.routing.factory import build_router
from agentloop.routing.manager import AsyncLLMServerManager, LLMServerClient
from agentloop.routing.strategies import (
    Balancer,
    LeastInFlight,
    RouteContext,
    RoutingStrategy,
    StickySession,
    make_balancer,
)

__all__ = [
    "AsyncLLMServerManager", "Balancer", "BalancerActor", "LLMServerClient", "LeastInFlight",
    "RemoteBalancer", "RouteContext", "RoutingStrategy", "StickySession", "build_router",
    "create_global_balancer", "make_balancer",
]
