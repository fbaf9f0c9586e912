"""Dead rollout servers: found, taken out of routing, restarted in the background, put back.

The router fails requests over the moment a server dies (:mod:`agentloop.routing.manager`); this module is
the manager's side.  :class:`ServerSupervisor`

1. **finds** dead servers after every batch: each server's ``check_health`` (a dead actor, or a live actor
   whose engine process died, raises), plus the ones the routers marked down;
2. **restarts** each in its own placement slot (same bundle / node, same config): the old actor is shut down
   and killed, a new one is created and its ``start`` runs in the background while batches go on;
3. **puts it back** once started: at version 0 (no weight update yet) at once; after weight updates, the
   restarted engine holds the initial weights, so it waits out of routing until the next
   :meth:`AgentLoopManager.update_weights` loads the current ones into it.  Putting back means: the handle
   replaces the dead one in the manager, in every worker's router and in the shared balancer (``mark_up``).

A server found dead (or not answering in time) **during a weight update** is handled the same way there
(:meth:`ServerSupervisor.settle`): the update goes on with the others instead of failing or hanging.
Servers the manager did not start (an ``llm_client``'s) are marked down but not restarted.
``counts`` holds ``server_restarts`` and ``servers_down`` for the batch metrics.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from agentloop.errors import first_line
from agentloop.servers.base import ServerDeadError
from agentloop.servers.placement import ServerGroup

logger = logging.getLogger(__name__)


def _why(error: BaseException) -> str:
    """One line on why a server call failed: the server's own error rather than Ray's wrapper around it."""
    cause = getattr(error, "cause", None)
    return first_line(cause if isinstance(cause, BaseException) else error)


@dataclass
class _Restart:
    handle: Any
    started: Any
    """The pending ``start()`` call."""
    needs_weights: bool = False


@dataclass
class ServerSupervisor:
    """See the module docstring.

    Args:
        group: the manager's servers (``handles`` is updated in place when a server is put back).
        balancer: the GlobalBalancer actor, or None (a single server: workers route locally).
        swap: ``swap(index, handle)`` hands a put-back server to every worker's router.
        restart: restart dead servers (``rollout.server.restart_dead``); False: only take them out.
        health_timeout_s: how long a health probe may take before the server is reported (not restarted:
            a busy engine may answer slowly).
    """

    group: ServerGroup
    balancer: Any
    swap: Callable[[int, Any], None]
    restart: bool = True
    health_timeout_s: float = 30.0
    down: set[int] = field(default_factory=set)
    restarting: dict[int, _Restart] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: {"server_restarts": 0})

    @property
    def can_restart(self) -> bool:
        return self.restart and self.group.restartable

    def check(self) -> list[int]:
        """Probe every serving server; newly dead ones are marked down (and restarts begun).  Returns them."""
        handles = self.group.handles
        probe = {i: h.check_health.remote() for i, h in enumerate(handles)
                 if i not in self.down and i not in self.restarting}
        if not probe:
            return []
        refs = list(probe.values())
        done, pending = ray.wait(refs, num_returns=len(refs), timeout=self.health_timeout_s)
        if pending:
            slow = [i for i, r in probe.items() if r in pending]
            logger.warning("servers %s did not answer a health check within %ss; left in routing", slow,
                           self.health_timeout_s)
        dead = []
        for i, ref in probe.items():
            if ref not in done:
                continue
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 - any failure to answer means the server cannot serve
                logger.warning("rollout server %d is dead: %s", i, _why(e))
                dead.append(i)
        for i in dead:
            self._take_out(i)
        return dead

    def settle(self, calls: dict[int, Any], timeout: float | None, what: str) -> dict[int, Any]:
        """Wait for one call per server (index -> ObjectRef; serving servers and restarted ones awaiting weights)
        and return the results of those that answered.  A server whose actor or engine died, or that gave no
        answer within ``timeout`` seconds (None: no limit), is taken out and restarted (as after a batch) and
        left out of the result; any other error is raised (it is not the server's fault: e.g. a bad tensor)."""
        if not calls:
            return {}
        refs = list(calls.values())
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        finished, results = set(done), {}
        for i, ref in calls.items():
            if ref not in finished:
                self.lose(i, f"no answer to {what} within {timeout:g} s")
                continue
            try:
                results[i] = ray.get(ref)
            except (ray.exceptions.RayActorError, ServerDeadError) as e:
                self.lose(i, f"died during {what}: {_why(e)}")
        return results

    def each(self, method: str, timeout: float | None, only: list[bool] | None = None,
             **kwargs: Any) -> dict[int, Any]:
        """Call ``method(**kwargs)`` on every serving server (where ``only[i]``) and return the answers by index.
        A server that died, or gives no answer within ``timeout`` seconds, is taken out of routing and restarted
        (:meth:`settle`) instead of failing the caller (pause, resume, sleep, wake_up, ...)."""
        calls = {i: getattr(h, method).remote(**kwargs) for i, h in enumerate(self.group.handles)
                 if i not in self.down and (only is None or only[i])}
        return self.settle(calls, float(timeout) if timeout is not None else None, method)

    def lose(self, index: int, reason: str) -> None:
        """Server ``index`` cannot serve (``reason``): out of routing and restarted where this manager can
        (:meth:`_take_out`); a restarted one that was waiting for weights is started again."""
        logger.warning("rollout server %d %s; it is taken out of routing", index, reason)
        if index in self.restarting:
            ray.kill(self.restarting.pop(index).handle, no_restart=True)
            if self.can_restart:
                self._begin_restart(index)
        elif index not in self.down:
            self._take_out(index)

    def _take_out(self, index: int) -> None:
        self.down.add(index)
        if self.balancer is not None:
            ray.get(self.balancer.mark_down.remote(index))
        if self.can_restart:
            self._begin_restart(index)
        else:
            logger.error("rollout server %d is dead and cannot be restarted by this manager (%s servers%s); "
                         "it stays out of routing", index, self.group.placement,
                         "" if self.restart else ", rollout.server.restart_dead=false")

    def _begin_restart(self, index: int) -> None:
        old = self.group.handles[index]
        with contextlib.suppress(Exception):  # it is dead or dying; killing it is what matters
            ray.get(old.shutdown.remote(), timeout=10)
        ray.kill(old, no_restart=True)
        handle = self.group.relaunch(index)
        self.restarting[index] = _Restart(handle, handle.start.remote())
        slot = self.group.slots[index].facts if index < len(self.group.slots) else {}
        logger.warning("rollout server %d: restarting it in its slot (%s)", index, slot or self.group.placement)

    def poll(self, weight_version: int, wait_s: float = 0.0) -> list[int]:
        """Put back restarted servers that finished starting (those needing weights wait for an update);
        returns the indices put back.  ``wait_s``: wait that long for pending starts (0: just look)."""
        pending = {r.started: i for i, r in self.restarting.items() if not r.needs_weights}
        if not pending:
            return []
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=wait_s)
        back = []
        for ref in done:
            i = pending[ref]
            try:
                info = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - a failed restart is retried at the next check
                logger.error("rollout server %d failed to restart: %s; trying again after the next batch", i,
                             first_line(e))
                ray.kill(self.restarting.pop(i).handle, no_restart=True)
                self._begin_restart(i)
                continue
            if self.group.slots and i < len(self.group.info):
                self.group.info[i] = {**(info or {}), **self.group.slots[i].facts}
            if weight_version > 0:
                self.restarting[i].needs_weights = True
                logger.warning("rollout server %d restarted with the initial weights; it rejoins after the next "
                               "update_weights (now at version %d)", i, weight_version)
                continue
            self._put_back(i)
            back.append(i)
        return back

    def awaiting_weights(self) -> dict[int, Any]:
        """Restarted servers that need the current weights before they serve: index -> handle."""
        return {i: r.handle for i, r in self.restarting.items() if r.needs_weights}

    def weights_loaded(self, indices: list[int]) -> None:
        """The update just finished loaded these restarted servers: put them back."""
        for i in indices:
            self._put_back(i)

    def _put_back(self, index: int) -> None:
        restart = self.restarting.pop(index)
        self.group.handles[index] = restart.handle
        self.swap(index, restart.handle)
        if self.balancer is not None:
            ray.get(self.balancer.mark_up.remote(index))
        self.down.discard(index)
        self.counts["server_restarts"] += 1
        logger.warning("rollout server %d is back in routing", index)
