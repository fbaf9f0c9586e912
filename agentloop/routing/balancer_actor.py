"""GlobalBalancer: one Ray actor holding the balancer shared by every AgentLoopWorker.

The actor is single-threaded (``max_concurrency=1``) so in-flight counts stay consistent.  Workers
talk to it through :class:`RemoteBalancer`, which coalesces calls: while one round trip is in
flight, new acquires and releases queue up and go out together in the next one.  Under load a
worker therefore makes a handful of actor calls per batch instead of two per request (measured:
the per-request version cost ~25% throughput on the overhead benchmark, see docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from agentloop.routing.prefix_affinity import build_balancer


class BalancerActor:
    """Actor body: a :class:`~agentloop.routing.strategies.Balancer` behind remote methods."""

    def __init__(self, num_servers: int, **kwargs: Any) -> None:
        """``kwargs``: :func:`~agentloop.routing.prefix_affinity.build_balancer`'s (``routing``,
        ``max_cache_size``, ...)."""
        self.balancer = build_balancer(num_servers, **kwargs)

    def acquire(self, request_id: str, prompt_len: int = 0, owner: str | None = None) -> int:
        """Choose a server for ``request_id`` and count it in flight."""
        return self.balancer.acquire(request_id, prompt_len, owner)

    def release(self, server: int, owner: str | None = None) -> None:
        """A request on ``server`` ended."""
        self.balancer.release(server, owner)

    def acquire_many(
        self, requests: list[tuple[Any, ...]], releases: list[int], owner: str | None = None
    ) -> list[int]:
        """Apply ``releases`` first, then acquire a server for each ``(request_id, prompt_len)``
        or ``(request_id, prompt_len, prefix)`` (``server.routing: prefix``), all for ``owner``."""
        for server in releases:
            self.balancer.release(server, owner)
        return [self.balancer.acquire(req[0], req[1], owner, *req[2:]) for req in requests]

    def release_owner(self, owner: str) -> int:
        """Release the slots a dead worker still held; returns how many."""
        return self.balancer.release_owner(owner)

    def mark_down(self, server: int) -> None:
        """Stop routing to a dead server."""
        self.balancer.mark_down(server)

    def mark_up(self, server: int) -> None:
        """Route to a restarted server again."""
        self.balancer.mark_up(server)

    def lookup(self, request_id: str) -> int | None:
        """The server ``request_id`` is bound to, if any."""
        return self.balancer.lookup(request_id)

    def ensure_cache_capacity(self, entries: int) -> int:
        """Grow the sticky cache to at least ``entries`` bindings; returns the capacity."""
        return self.balancer.ensure_cache_capacity(entries)

    def stats(self) -> dict[str, list[int]]:
        """In-flight and total routed counts per server, and their health."""
        return self.balancer.stats()


def create_global_balancer(num_servers: int, *, name: str | None = None, **kwargs: Any) -> Any:
    """Start the shared balancer actor (no CPU reserved) on the caller's node and return its handle.

    Pinned to the caller's (the manager's) node: with no CPU reserved Ray may put it on any node,
    and losing that node would take routing away from every worker (found by
    tests/integration/test_multinode.py).
    """
    options: dict[str, Any] = {
        "num_cpus": 0,
        "max_concurrency": 1,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False
        ),
    }
    if name:
        options["name"] = name
    return ray.remote(BalancerActor).options(**options).remote(num_servers, **kwargs)


class RemoteBalancer:
    """Async client of a GlobalBalancer actor that batches acquires and releases.

    ``acquire`` resolves once the actor has chosen a server; ``release`` is fire-and-forget and
    rides on the next round trip (one is started at once if none is in flight).  An acquire whose
    caller was cancelled while waiting is released automatically, so no slot leaks.
    ``release(server, now=True)`` submits the release to the actor synchronously instead: use it
    when the caller is being cancelled, since a round-trip task started then may never run (the
    event loop may be shutting down).
    """

    def __init__(self, handle: Any, owner: str | None = None) -> None:
        self.handle = handle
        self.owner = owner
        """Whose slots these are (the worker's id): the manager releases them all if the worker
        dies."""
        self._acquires: list[tuple[str, int, asyncio.Future[int], tuple[int, ...]]] = []
        self._releases: list[int] = []
        self._busy = False
        # strong reference: unreferenced tasks can be collected
        self._task: asyncio.Task[None] | None = None

    async def acquire(
        self, request_id: str, prompt_len: int = 0, prefix: tuple[int, ...] = ()
    ) -> int:
        """Ask the actor for a server (batched with concurrent acquires and pending releases);
        ``prefix``: the prompt's prefix keys (``server.routing: prefix``)."""
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._acquires.append((request_id, prompt_len, future, prefix))
        self._kick()
        return await future

    def release(self, server: int, *, now: bool = False) -> None:
        """Give ``server``'s slot back: batched, or submitted at once (no await) when ``now``."""
        if now:
            self._send_releases([server])
            return
        self._releases.append(server)
        self._kick()

    def _send_releases(self, servers: list[int]) -> None:
        """Submit releases without awaiting; Ray runs the call even though its result is dropped."""
        self.handle.acquire_many.remote([], servers, self.owner)

    def _kick(self) -> None:
        if not self._busy and (self._acquires or self._releases):
            self._busy = True
            self._task = asyncio.get_running_loop().create_task(self._round_trip())

    async def _round_trip(self) -> None:
        """Send queued acquires and releases in one call until the queues are empty."""
        try:
            while self._acquires or self._releases:
                batch, self._acquires = self._acquires, []
                releases, self._releases = self._releases, []
                await self._trip(batch, releases)
        finally:
            # cancelled mid-trip (loop shutting down): do not lose queued releases
            if self._releases:
                self._send_releases(self._releases)
                self._releases = []
            self._busy = False
            self._task = None

    async def _trip(
        self, batch: list[tuple[str, int, asyncio.Future[int], tuple[int, ...]]],
        releases: list[int],
    ) -> None:
        """One actor call: apply ``releases``, acquire for ``batch`` and resolve its futures."""
        requests = [(r, p, k) if k else (r, p) for r, p, _, k in batch]
        ref = self.handle.acquire_many.remote(requests, releases, self.owner)
        try:
            servers = await ref
        # the loop is going away: nobody will use what the call acquires
        except asyncio.CancelledError:
            for _, _, fut, _ in batch:
                fut.cancel()
            if isinstance(ref, ray.ObjectRef):
                ref.future().add_done_callback(self._release_result)
            raise
        except Exception as e:  # noqa: BLE001 - handed to every waiter
            for _, _, fut, _ in batch:
                if not fut.done():
                    fut.set_exception(e)
            return
        for (_, _, fut, _), server in zip(batch, servers, strict=True):
            if fut.cancelled():
                self._releases.append(server)
            else:
                fut.set_result(server)

    def _release_result(self, done: concurrent.futures.Future[list[int]]) -> None:
        """Done-callback (a Ray thread): release the servers an abandoned acquire call got."""
        if not done.cancelled() and done.exception() is None and done.result():
            self._send_releases(done.result())
