"""Routing strategies: plain Python, no Ray, no asyncio.

Servers are numbered ``0..N-1``.  A strategy picks one for a request given the current in-flight
counts; :class:`Balancer` owns the counts (``acquire`` on start, ``release`` on end — success,
error or cancellation alike).  The default is :func:`make_balancer`: sticky by request id (an LRU
of ``max_cache_size`` entries, verl's default 10000, grown to the batch by
:meth:`Balancer.ensure_cache_capacity` so a 100k-sample batch never evicts the binding of a sample
still running) wrapping least-in-flight with a random tie-break, so ties never pin to server 0.

Faults: a server marked down (:meth:`Balancer.mark_down`, when a request found it dead) is never
chosen until :meth:`Balancer.mark_up`; a request stuck to it is re-bound to a healthy one. In-flight
counts are also kept per owner (one per agent-loop worker), so a worker that dies holding slots has
them released with :meth:`Balancer.release_owner` instead of leaving its servers looking busy
forever.
"""

from __future__ import annotations

import bisect
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from agentloop.errors import RoutingError


@dataclass
class RouteContext:
    """What a strategy may look at when choosing a server."""

    request_id: str
    prompt_len: int = 0
    prefix: tuple[int, ...] = ()
    """Keys of nested prefixes of the prompt, shortest first
    (:func:`agentloop.routing.prefix_affinity.prefix_keys`; the simulator
    passes its own); empty unless the router was built for ``server.routing: prefix``."""


class RoutingStrategy(Protocol):
    """Picks a server index for a request."""

    def choose(self, ctx: RouteContext, in_flight: Sequence[int]) -> int: ...


class LeastInFlight:
    """The server with the fewest in-flight requests; ties broken at random or by rotation.

    With ``k`` servers tied at the lowest count, ``random`` picks the ``randrange(k)``-th of them
    (in index order) and ``rotate`` the ``cursor % k``-th, the cursor advancing once per tied
    choice.  A decision is O(N) but at C speed: one pass for the minimum, one for the tie count, and
    at most ``k / 2`` index searches for the chosen tied server, never a Python-level loop over the
    servers (``scripts/bench_balancer.py``: 1.2-1.6x the decisions/s of the list-building scan it
    replaced at 8-256 servers, the same choices).
    """

    def __init__(self, tie_break: str = "random", seed: int | None = None) -> None:
        if tie_break not in ("random", "rotate"):
            raise RoutingError(f"tie_break must be 'random' or 'rotate', got {tie_break!r}")
        self.tie_break = tie_break
        self._rng = random.Random(seed)
        self._cursor = 0

    def choose(self, ctx: RouteContext, in_flight: Sequence[int]) -> int:
        counts = in_flight if isinstance(in_flight, list) else list(in_flight)
        low = min(counts)
        tied = counts.count(low)
        if tied == 1:
            return counts.index(low)
        if self.tie_break == "random":
            k = self._rng.randrange(tied)  # the same draw as ``choice`` over the tied list
        else:
            self._cursor += 1
            k = self._cursor % tied
        if tied == len(counts):
            return k
        return self._nth_index(counts, low, k, tied)

    @staticmethod
    def _nth_index(counts: list[int], value: int, k: int, total: int) -> int:
        """Index of the ``k``-th (0-based) of the ``total`` occurrences of ``value`` in ``counts``,
        searching from whichever end is nearer."""
        if k < total // 2:
            i = counts.index(value)
            for _ in range(k):
                i = counts.index(value, i + 1)
            return i
        rev = counts[::-1]
        i = rev.index(value)
        for _ in range(total - 1 - k):
            i = rev.index(value, i + 1)
        return len(counts) - 1 - i


class BucketedLeastInFlight(LeastInFlight):
    """:class:`LeastInFlight` in O(log N) per decision: the servers are kept in buckets by in-flight
    count (each a sorted list), so a choice reads the lowest bucket instead of scanning every
    server.  The same choices (the ``k``-th tied server in index order, ``k`` drawn as
    ``LeastInFlight`` draws it).

    It must see every count change: the :class:`Balancer` it serves calls :meth:`track` once and
    :meth:`moved` on each change.  A view it does not track (the balancer's health-filtered one
    while a server is down) is scanned as ``LeastInFlight`` does.  :func:`make_balancer` uses it
    from 32 servers on, where it is faster (``scripts/bench_balancer.py``: 2.5x the scan at 256
    servers; slower than the scan at 8).
    """

    def __init__(self, tie_break: str = "random", seed: int | None = None) -> None:
        super().__init__(tie_break, seed)
        self._tracked: list[int] | None = None
        self._buckets: dict[int, list[int]] = {}
        self._low = 0

    def track(self, in_flight: list[int]) -> None:
        """Follow ``in_flight`` (the balancer's own list, changed only through :meth:`moved` from
        now on)."""
        self._tracked = in_flight
        self._buckets = {}
        for server, count in enumerate(in_flight):
            self._buckets.setdefault(count, []).append(server)
        self._low = min(self._buckets) if self._buckets else 0

    def moved(self, server: int, old: int, new: int) -> None:
        """Server ``server``'s count went from ``old`` to ``new``."""
        if old == new or self._tracked is None:
            return
        bucket = self._buckets[old]
        del bucket[bisect.bisect_left(bucket, server)]
        if not bucket:
            del self._buckets[old]
        bisect.insort(self._buckets.setdefault(new, []), server)
        if new < self._low:
            self._low = new
        elif old == self._low and old not in self._buckets:
            self._low = new if new == old + 1 else min(self._buckets)

    def choose(self, ctx: RouteContext, in_flight: Sequence[int]) -> int:
        if in_flight is not self._tracked:
            return super().choose(ctx, in_flight)
        tied = self._buckets[self._low]
        if len(tied) == 1:
            return tied[0]
        if self.tie_break == "random":
            return tied[self._rng.randrange(len(tied))]
        self._cursor += 1
        return tied[self._cursor % len(tied)]


class StickySession:
    """Requests with a known id go back to their server (prefix cache); others ask ``fallback``."""

    def __init__(self, fallback: RoutingStrategy, max_cache_size: int = 10000) -> None:
        self.fallback = fallback
        self.max_cache_size = max_cache_size
        self._cache: OrderedDict[str, int] = OrderedDict()

    def lookup(self, request_id: str) -> int | None:
        """The server a request id is bound to, if any."""
        return self._cache.get(request_id)

    def choose(self, ctx: RouteContext, in_flight: Sequence[int]) -> int:
        server = self._cache.get(ctx.request_id)
        if server is not None:
            self._cache.move_to_end(ctx.request_id)
            return server
        server = self.fallback.choose(ctx, in_flight)
        self._cache[ctx.request_id] = server
        if len(self._cache) > self.max_cache_size:
            self._cache.popitem(last=False)
        return server

    def forget(self, request_id: str) -> None:
        """Drop a request id's binding."""
        self._cache.pop(request_id, None)

    def track(self, in_flight: list[int]) -> None:
        """Pass the balancer's counts on to a fallback that follows them
        (:class:`BucketedLeastInFlight`)."""
        track = getattr(self.fallback, "track", None)
        if track is not None:
            track(in_flight)

    @property
    def follows_counts(self) -> bool:
        """Whether the fallback keeps its own view of the in-flight counts (only then does the
        balancer tell this strategy of each change)."""
        return getattr(self.fallback, "moved", None) is not None

    def moved(self, server: int, old: int, new: int) -> None:
        moved = getattr(self.fallback, "moved", None)
        if moved is not None:
            moved(server, old, new)

    def ensure_capacity(self, entries: int) -> int:
        """Keep at least ``entries`` bindings (never shrinks); returns the capacity now."""
        self.max_cache_size = max(self.max_cache_size, int(entries))
        return self.max_cache_size


class Balancer:
    """In-flight accounting around a strategy, with per-server health and per-owner slot counts."""

    def __init__(self, num_servers: int, strategy: RoutingStrategy) -> None:
        if num_servers < 1:
            raise RoutingError("no servers to route to: the balancer needs at least one server")
        self.num_servers = num_servers
        self.strategy = strategy
        self.in_flight = [0] * num_servers
        self.routed = [0] * num_servers
        self.healthy = [True] * num_servers
        self._num_down = 0
        """Servers marked down (kept with :attr:`healthy`: a decision checks a count, not every
        server)."""
        self._owned: dict[str, list[int]] = {}
        track = getattr(strategy, "track", None)
        self._moved = (
            getattr(strategy, "moved", None) if getattr(strategy, "follows_counts", True) else None
        )
        """Told of every in-flight count change, for a strategy that keeps its own ordered view."""
        if track is not None:
            track(self.in_flight)

    def acquire(
        self, request_id: str, prompt_len: int = 0, owner: str | None = None,
        prefix: tuple[int, ...] = (),
    ) -> int:
        """Choose a healthy server for a request starting now and count it in flight (for
        ``owner`` too); ``prefix``: :attr:`RouteContext.prefix`."""
        if not self._num_down:
            server = self.strategy.choose(
                RouteContext(request_id, prompt_len, prefix), self.in_flight
            )
        else:
            server = self._choose_healthy(RouteContext(request_id, prompt_len, prefix))
        count = self.in_flight[server]
        self.in_flight[server] = count + 1
        if self._moved is not None:
            self._moved(server, count, count + 1)
        self.routed[server] += 1
        if owner is not None:
            self._owned.setdefault(owner, [0] * self.num_servers)[server] += 1
        return server

    def _choose_healthy(self, ctx: RouteContext) -> int:
        if not any(self.healthy):
            raise RoutingError(
                f"all {self.num_servers} rollout servers are marked down (their engines "
                f"died); requests fail until "
                "one is restarted (the AgentLoopManager restarts dead servers it started; "
                "see docs/faults.md)"
            )
        down = 1 << 40  # a down server looks infinitely busy to least-in-flight strategies
        view = [c if ok else down for c, ok in zip(self.in_flight, self.healthy, strict=True)]
        server = self.strategy.choose(ctx, view)
        if not self.healthy[server]:  # stuck to a dead server (sticky session): bind it anew
            forget = getattr(self.strategy, "forget", None)
            if forget is not None:
                forget(ctx.request_id)
                server = self.strategy.choose(ctx, view)
            if not self.healthy[server]:
                server = min(
                    (i for i in range(self.num_servers) if self.healthy[i]), key=lambda i: view[i]
                )
        return server

    def release(self, server: int, owner: str | None = None) -> None:
        """A request on ``server`` ended (any way).  With an ``owner`` whose slots were already
        released (:meth:`release_owner`), nothing changes."""
        if not 0 <= server < self.num_servers:
            raise RoutingError(
                f"release: server index {server} out of range 0..{self.num_servers - 1}"
            )
        if owner is not None:
            owned = self._owned.get(owner)
            if owned is None or owned[server] <= 0:
                return
            owned[server] -= 1
        count = self.in_flight[server]  # _set's work, inline (once per request)
        self.in_flight[server] = count - 1 if count > 0 else 0
        if self._moved is not None:
            self._moved(server, count, self.in_flight[server])

    def _set(self, server: int, count: int) -> None:
        before, self.in_flight[server] = self.in_flight[server], count
        if self._moved is not None:
            self._moved(server, before, count)

    def release_owner(self, owner: str) -> int:
        """Release every slot ``owner`` still holds (it died); returns how many."""
        owned = self._owned.pop(owner, None)
        if owned is None:
            return 0
        for server, n in enumerate(owned):
            if n:
                self._set(server, max(0, self.in_flight[server] - n))
        return sum(owned)

    def mark_down(self, server: int) -> None:
        """Stop routing to ``server`` (its engine died)."""
        if self.healthy[server]:
            self._num_down += 1
        self.healthy[server] = False

    def mark_up(self, server: int) -> None:
        """Route to ``server`` again (restarted and checked); its old in-flight count is dropped."""
        if not self.healthy[server]:
            self._num_down -= 1
        self.healthy[server] = True
        self._set(server, 0)
        for owned in self._owned.values():
            owned[server] = 0

    def ensure_cache_capacity(self, entries: int) -> int:
        """Grow a sticky strategy's binding cache to at least ``entries`` (the manager passes a
        multiple of the batch, or of the Rollouter's in-flight budget, so bindings of running
        samples are never evicted); returns the capacity (0 when the strategy is not sticky)."""
        grow = getattr(self.strategy, "ensure_capacity", None)
        return int(grow(entries)) if grow is not None else 0

    def lookup(self, request_id: str) -> int | None:
        """The server a request id is bound to, when the strategy is sticky."""
        return (
            self.strategy.lookup(request_id) if isinstance(self.strategy, StickySession) else None
        )

    def stats(self) -> dict[str, list[int]]:
        """Current in-flight and total routed counts per server, and which servers are healthy
        (1) or down (0)."""
        return {"in_flight": list(self.in_flight), "routed": list(self.routed),
                "healthy": [int(h) for h in self.healthy]}


def make_balancer(
    num_servers: int, *, max_cache_size: int = 10000, tie_break: str = "random",
    seed: int | None = None,
) -> Balancer:
    """The default: sticky by request id over least in-flight (bucketed from 32 servers on: same
    choices)."""
    least = (BucketedLeastInFlight if num_servers >= 32 else LeastInFlight)(tie_break, seed)
    return Balancer(num_servers, StickySession(least, max_cache_size))
