"""GlobalBalancer: one Ray actor holding the balancer shared by every AgentLoopWorker.

Single-threaded (``max_concurrency=1``) so in-flight counts stay consistent; each call is a
~1 ms round trip, awaited by the async router without blocking the worker's event loop.
"""

from __future__ import annotations

from typing import Any

import ray

from agentloop.routing.strategies import make_balancer


class BalancerActor:
    """Actor body: a :class:`~agentloop.routing.strategies.Balancer` behind remote methods."""

    def __init__(self, num_servers: int, **kwargs: Any) -> None:
        self.balancer = make_balancer(num_servers, **kwargs)

    def acquire(self, request_id: str, prompt_len: int = 0) -> int:
        return self.balancer.acquire(request_id, prompt_len)

    def release(self, server: int) -> None:
        self.balancer.release(server)

    def lookup(self, request_id: str) -> int | None:
        return self.balancer.lookup(request_id)

    def stats(self) -> dict[str, list[int]]:
        return self.balancer.stats()


def create_global_balancer(num_servers: int, *, name: str | None = None, **kwargs: Any) -> Any:
    """Start the shared balancer actor (no CPU reserved) and return its handle."""
    options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 1}
    if name:
        options["name"] = name
    return ray.remote(BalancerActor).options(**options).remote(num_servers, **kwargs)
