"""Routing: strategies (plain Python), the shared balancer actor and the async client."""

from agentloop.routing.balancer_actor import BalancerActor, RemoteBalancer, create_global_balancer
from agentloop.routing.factory import build_router
from agentloop.routing.manager import AsyncLLMServerManager, LLMServerClient
from agentloop.routing.prefix_affinity import PrefixAffinity, build_balancer, prefix_keys
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
    "PrefixAffinity", "RemoteBalancer", "RouteContext", "RoutingStrategy", "StickySession",
    "build_balancer", "build_router", "create_global_balancer", "make_balancer", "prefix_keys",
]
