"""Finding actors whose event loop is blocked, without ever waiting on them.

An asyncio actor answers a trivial call at once unless its event loop is blocked (a synchronous call
that never returns, a deadlock).  :class:`HangWatch` keeps at most one such probe in flight per
actor and, at each look, reports the actors whose probe has gone unanswered for ``hang_s`` seconds.
A probe still in flight when a batch ends is judged at the next batch's first look: answered by
then, it counts as answered; still unanswered, the actor has been blocked all that time.  Used while
batches run for rollout servers (:class:`agentloop.cluster.supervisor.ServerSupervisor`), agent-loop
workers (:class:`agentloop.rollout.dispatcher.Dispatcher`) and gateways
(:mod:`agentloop.gateway.actor`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

import ray

K = TypeVar("K", bound=Hashable)


class HangWatch(Generic[K]):
    """One probe in flight per watched actor (keyed by ``K``: a server index, a worker slot); see
    the module docstring."""

    def __init__(self) -> None:
        # key -> (actor probed, pending call, sent at)
        self._probes: dict[K, tuple[Any, Any, float]] = {}

    def look(
        self, actors: dict[K, Any], probe: Callable[[Any], Any], hang_s: float
    ) -> tuple[list[K], dict[K, Any]]:
        """Probe each of ``actors`` (key -> handle) that has no probe in flight (``probe(handle)``
        makes the call) and return ``(hung, answered)``: the keys whose probe is unanswered after
        ``hang_s`` seconds (forgotten here; the caller kills them), and key -> the finished call of
        those that answered (``ray.get`` it to see whether the answer was an error).  Keys no longer
        in ``actors``, or whose handle changed, start over."""
        now = time.monotonic()
        for key in [k for k, p in self._probes.items() if actors.get(k) is not p[0]]:
            del self._probes[key]
        for key, handle in actors.items():
            if key not in self._probes:
                self._probes[key] = (handle, probe(handle), now)
        if not self._probes:
            return [], {}
        refs = [ref for _, ref, _ in self._probes.values()]
        done = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        hung: list[K] = []
        answered: dict[K, Any] = {}
        for key, (_, ref, sent) in list(self._probes.items()):
            if ref in done:
                answered[key] = ref
                del self._probes[key]
            elif now - sent >= hang_s:
                hung.append(key)
                del self._probes[key]
        return hung, answered
