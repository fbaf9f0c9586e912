"""KV-cache-aware routing: prefix affinity balanced against load, with a move policy.

``server.routing: prefix`` (docs/routing.md#kv-cache-aware-routing-serverrouting-prefix). On top of
verl's sticky request-id binding (a trajectory's turns go back to the server holding its context),
a request with no binding yet (a trajectory's first turn, a sub-agent, a GRPO sibling) goes to a
server that recently served the longest prefix it shares with earlier requests, if that server is
not much busier than the least-loaded one; a bound request whose server is overloaded is moved when
the imbalance outweighs the re-prefill of its context.

The prefix is known by keys (:attr:`~agentloop.routing.strategies.RouteContext.prefix`): the
router hashes the prompt's first 32, 64, 128, ... tokens and all of it (:func:`prefix_keys`, up to
``max_tokens``), so requests sharing a system prompt share the short keys and GRPO siblings (one
prompt, ``rollout.n`` samples) share them all.  The strategy keeps, per key, the few servers that
served it last (an LRU of keys): an estimate of what each server's prefix cache holds, never asked
of the engine.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from agentloop.errors import RoutingError
from agentloop.routing.strategies import (
    Balancer,
    BucketedLeastInFlight,
    LeastInFlight,
    RouteContext,
    RoutingStrategy,
    StickySession,
    make_balancer,
)

ROUTINGS = ("sticky", "prefix")
"""The values of ``server.routing``: verl's sticky least-in-flight (the default) or
:class:`PrefixAffinity`."""

FIRST_BLOCK = 32
"""Tokens in the first prefix key; each further key covers twice as many."""


def prefix_keys(prompt_ids: Sequence[int], max_tokens: int = 2048) -> tuple[int, ...]:
    """Chained hashes of the prompt's first 32, 64, 128, ... tokens and of all of it (at most
    ``max_tokens`` tokens), shortest first: the last key is the whole prompt's (GRPO siblings share
    it), the shorter ones what it shares with other prompts (a system prompt).

    Deterministic across processes (hashes of int tuples), so keys made in every worker agree in
    the shared balancer.  Cost: one pass over ``min(len(prompt_ids), max_tokens)`` tokens
    (~5 ns each).
    """
    n = min(len(prompt_ids), max_tokens)
    if n < FIRST_BLOCK:
        return (hash(tuple(prompt_ids[:n])),) if n else ()
    keys: list[int] = []
    start, end, h = 0, FIRST_BLOCK, 0
    while end <= n:
        h = hash((h, tuple(prompt_ids[start:end])))
        keys.append(h)
        start, end = end, end * 2
    if start < n:
        keys.append(hash((h, tuple(prompt_ids[start:n]))))
    return tuple(keys)


class PrefixAffinity(StickySession):
    """Sticky by request id; new bindings by prefix affinity within a load slack; moves of
    overloaded sessions when the imbalance outweighs the re-prefill.

    Args:
        fallback: least-loaded strategy (:class:`~agentloop.routing.strategies.LeastInFlight`).
        max_cache_size: request-id bindings kept (grown like :class:`StickySession`'s).
        balance_slack: a prefix owner is chosen only while its in-flight count is at most this
            much above the least-loaded server's.
        move_slack, move_tokens_per_slot: a bound request moves to the least-loaded server when its
            server has more than ``move_slack + prompt_len / move_tokens_per_slot`` requests more
            in flight (the re-prefill of ``prompt_len`` tokens counted as that many slots); None
            never moves (verl's stickiness).
        max_owners: servers remembered per key (the most recent).
        keys_per_binding: the key LRU holds this many keys per request-id binding.

    Raises:
        RoutingError: a negative slack or a non-positive size.
    """

    def __init__(
        self, fallback: RoutingStrategy, max_cache_size: int = 10000, *,
        balance_slack: int = 8, move_slack: int | None = 32, move_tokens_per_slot: int = 256,
        max_owners: int = 4, keys_per_binding: int = 4,
    ) -> None:
        super().__init__(fallback, max_cache_size)
        if balance_slack < 0 or (move_slack is not None and move_slack < 0):
            raise RoutingError("balance_slack and move_slack must be >= 0")
        if move_tokens_per_slot < 1 or max_owners < 1 or keys_per_binding < 1:
            raise RoutingError(
                "move_tokens_per_slot, max_owners and keys_per_binding must be >= 1"
            )
        self.balance_slack = balance_slack
        self.move_slack = move_slack
        self.move_tokens_per_slot = move_tokens_per_slot
        self.max_owners = max_owners
        self.keys_per_binding = keys_per_binding
        self._owners: OrderedDict[int, list[int]] = OrderedDict()
        self.affinity_hits = 0
        """New bindings sent to a server that served one of their prefix keys."""
        self.moves = 0
        """Bound requests moved off an overloaded server (each re-prefills its context)."""

    def choose(self, ctx: RouteContext, in_flight: Sequence[int]) -> int:
        server = self._cache.get(ctx.request_id)
        if server is not None and not self._should_move(server, ctx, in_flight):
            self._cache.move_to_end(ctx.request_id)
            self._remember(ctx.prefix, server)
            return server
        if server is not None:
            self.moves += 1
            server = self.fallback.choose(ctx, in_flight)
        else:
            server = self._by_prefix(ctx, in_flight)
        self._cache[ctx.request_id] = server
        self._cache.move_to_end(ctx.request_id)
        if len(self._cache) > self.max_cache_size:
            self._cache.popitem(last=False)
        self._remember(ctx.prefix, server)
        return server

    def _should_move(self, server: int, ctx: RouteContext, in_flight: Sequence[int]) -> bool:
        """Whether ``server`` (the binding) is loaded enough above the least-loaded server to pay
        for re-prefilling ``ctx.prompt_len`` tokens elsewhere."""
        if self.move_slack is None:
            return False
        excess = in_flight[server] - min(in_flight)
        return excess > self.move_slack + ctx.prompt_len / self.move_tokens_per_slot

    def _by_prefix(self, ctx: RouteContext, in_flight: Sequence[int]) -> int:
        """The least-loaded recent owner of the longest known prefix key, if it is within
        ``balance_slack`` (for the prompt's own last key; half that for a shorter, more widely
        shared one) of the least-loaded server and that server does not hold the key too; else the
        fallback's (least-loaded) choice.  The halved slack keeps a shared system prompt from
        pulling a new GRPO group onto a server its siblings would then have to leave."""
        least = self.fallback.choose(ctx, in_flight)
        limit = in_flight[least] + self.balance_slack
        for key in reversed(ctx.prefix):
            owners = self._owners.get(key)
            if owners:
                if least in owners:
                    return least
                best = min(owners, key=in_flight.__getitem__)
                if in_flight[best] <= limit:
                    self.affinity_hits += 1
                    return best
            limit = in_flight[least] + self.balance_slack // 2
        return least

    def _remember(self, prefix: tuple[int, ...], server: int) -> None:
        """Record that ``server`` now holds every prefix in ``prefix`` (most recent owner last)."""
        owners_of = self._owners
        for key in prefix:
            owners = owners_of.get(key)
            if owners is None:
                owners_of[key] = [server]
                continue
            owners_of.move_to_end(key)
            if owners[-1] != server:
                if server in owners:
                    owners.remove(server)
                owners.append(server)
                if len(owners) > self.max_owners:
                    del owners[0]
        while len(owners_of) > self.max_cache_size * self.keys_per_binding:
            owners_of.popitem(last=False)


def build_balancer(
    num_servers: int, *, routing: str = "sticky", max_cache_size: int = 10000,
    tie_break: str = "random", seed: int | None = None, **options: Any,
) -> Balancer:
    """The balancer for ``server.routing``: ``sticky`` is
    :func:`~agentloop.routing.strategies.make_balancer` (verl's); ``prefix`` a
    :class:`PrefixAffinity` over the same least-in-flight (``options``: its keyword arguments).

    Raises:
        RoutingError: an unknown ``routing``, or options given for ``sticky``.
    """
    if routing not in ROUTINGS:
        raise RoutingError(
            f"server.routing must be one of {', '.join(ROUTINGS)}; got {routing!r}"
        )
    if routing == "sticky":
        if options:
            raise RoutingError(f"routing options {sorted(options)} need server.routing: prefix")
        return make_balancer(
            num_servers, max_cache_size=max_cache_size, tie_break=tie_break, seed=seed
        )
    least = (BucketedLeastInFlight if num_servers >= 32 else LeastInFlight)(tie_break, seed)
    return Balancer(num_servers, PrefixAffinity(least, max_cache_size, **options))
