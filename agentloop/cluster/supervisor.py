"""Dead rollout servers: found, taken out of routing, restarted in the background, put back.

The router fails requests over the moment a server dies (:mod:`agentloop.routing.manager`); this
module is the manager's side. :class:`ServerSupervisor` finds dead servers after every batch
(:meth:`~ServerSupervisor.check`), kills hung ones during a batch (:meth:`~ServerSupervisor.watch`,
``rollout.server.stall_timeout``), goes on without the lost ones during a weight update or another
call to every server (:meth:`~ServerSupervisor.settle`, :meth:`~ServerSupervisor.each`), restarts
each in its own placement slot while batches go on, and puts it back in routing once started
(:meth:`~ServerSupervisor.poll`; after a weight update only once the next ``update_weights`` has
loaded the current weights: :meth:`~ServerSupervisor.weights_loaded`). Servers the manager did not
start (an ``llm_client``'s) are taken out but not restarted. ``counts`` holds ``server_restarts``
and ``servers_hung`` for the batch metrics.

Spec: docs/faults.md#restarting-a-server.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from agentloop.cluster.placement import ServerGroup
from agentloop.errors import first_line
from agentloop.servers.base import ServerDeadError
from agentloop.utils.hangwatch import HangWatch

logger = logging.getLogger(__name__)


def _why(error: BaseException) -> str:
    """One line on why a server call failed: the server's own error rather than Ray's wrapper
    around it."""
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
        health_timeout_s: how long a health probe may take before the server is reported (not
        restarted:
            a busy engine may answer slowly).
        tell_down: ``tell_down(index)`` pushes a server taken out of routing to every worker's
            router (worker-local routing, no balancer actor: ``rollout.server.balancer: local``);
            None: the balancer actor is the one told. A put-back server reaches the routers by
            ``swap`` (their ``replace_server`` routes to it again).
    """

    group: ServerGroup
    balancer: Any
    swap: Callable[[int, Any], None]
    restart: bool = True
    health_timeout_s: float = 30.0
    tell_down: Callable[[int], None] | None = None
    down: set[int] = field(default_factory=set)
    restarting: dict[int, _Restart] = field(default_factory=dict)
    counts: dict[str, int] = field(
        default_factory=lambda: {"server_restarts": 0, "servers_hung": 0}
    )
    _hangs: HangWatch[int] = field(default_factory=HangWatch, repr=False)
    """:meth:`watch`'s health probes in flight."""
    updating: bool = False
    """True while ``update_weights`` runs (the manager sets it): :meth:`watch` then stays out of
    the way."""
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    """Held while ``down`` / ``restarting`` change: the Rollouter's thread (:meth:`poll`,
    :meth:`watch`) and the trainer's (``update_weights``, ``pause``, ...) both use the supervisor.
    Not held while waiting for servers' answers (only a dying server's own shutdown, at most 10 s).
    """

    @property
    def can_restart(self) -> bool:
        return self.restart and self.group.restartable

    def probe(self) -> dict[int, Any]:
        """Send a ``check_health`` probe to every serving server without waiting (the first half of
        :meth:`check`; the caller overlaps the round trip with other work). Returns ``{server
        index: pending reply}`` for :meth:`check`."""
        with self._lock:
            return {i: h.check_health.remote() for i, h in enumerate(self.group.handles)
                    if i not in self.down and i not in self.restarting}

    def check(self, probe: dict[int, Any] | None = None) -> list[int]:
        """Probe every serving server (or collect the replies of :meth:`probe`'s ``probe``); newly
        dead ones are marked down (and restarts begun). Returns them."""
        if probe is None:
            probe = self.probe()
        if not probe:
            return []
        refs = list(probe.values())
        end = time.monotonic() + self.health_timeout_s
        try:  # the usual case, every server well: one call for all (not one per server)
            ray.get(refs, timeout=self.health_timeout_s)
            return []
        except Exception:  # noqa: BLE001 - one dead or slow: found one by one below
            pass
        done, pending = ray.wait(
            refs, num_returns=len(refs), timeout=max(0.0, end - time.monotonic())
        )
        if pending:
            slow = [i for i, r in probe.items() if r in pending]
            logger.warning(
                "servers %s did not answer a health check within %ss; left in routing", slow,
                self.health_timeout_s,
            )
        dead = []
        for i, ref in probe.items():
            if ref not in done:
                continue
            try:
                ray.get(ref)
            # any failure to answer means the server cannot serve
            except Exception as e:  # noqa: BLE001
                logger.warning("rollout server %d is dead: %s", i, _why(e))
                dead.append(i)
        with self._lock:
            dead = [i for i in dead if i not in self.down and i not in self.restarting]
            for i in dead:
                self._take_out(i)
        return dead

    def watch(self, hang_s: float) -> list[int]:
        """A look at the serving servers while a batch runs (the manager calls it every few seconds;
        it never waits).  Each server has at most one ``check_health`` probe in flight.  A server
        whose probe is still unanswered after ``hang_s`` seconds is hung: its actor's event loop is
        blocked (a health check is an instant answer otherwise).  It is killed, so the requests it
        holds fail over at once instead of holding the batch, and restarted where this manager can.
        A probe that says the server died takes it out early (the routers already avoid it).
        Returns the servers taken out. Skipped (returns []) during a weight update (its own
        ``weight_update_timeout`` applies) and while another thread is changing the servers, so the
        Rollouter's thread never waits on it.
        """
        if self.updating or not self._lock.acquire(blocking=False):
            return []
        try:
            return self._watch(hang_s)
        finally:
            self._lock.release()

    def _watch(self, hang_s: float) -> list[int]:
        serving = {
            i: h
            for i, h in enumerate(self.group.handles)
            if i not in self.down and i not in self.restarting
        }
        hung, answered = self._hangs.look(serving, lambda h: h.check_health.remote(), hang_s)
        lost: dict[int, tuple[str, bool]] = {}  # index -> (why, hung)
        for i, ref in answered.items():
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ServerDeadError) as e:
                lost[i] = (f"failed a health check: {_why(e)}", False)
            # not a death; the check after the batch reports it
            except Exception:  # noqa: BLE001, S110
                pass
        for i in hung:
            lost[i] = (
                f"did not answer a health check for {hang_s:g} s "
                f"(rollout.server.stall_timeout): its "
                "event loop is blocked",
                True,
            )
            self.counts["servers_hung"] += 1
        for i, (reason, is_hung) in lost.items():
            self.lose(i, reason, hung=is_hung)
        return list(lost)

    def settle(self, calls: dict[int, Any], timeout: float | None, what: str,
               handles: dict[int, Any] | None = None) -> dict[int, Any]:
        """Wait for one call per server (index -> ObjectRef; serving servers and restarted ones
        awaiting weights) and return the results of those that answered.  A server whose actor or
        engine died, or that gave no answer within ``timeout`` seconds (None: no limit), is taken
        out and restarted (as after a batch) and left out of the result; any other error is raised
        (it is not the server's fault: e.g. a bad tensor). ``handles``: the actor each call went to,
        so a server another thread already replaced is left alone."""
        if not calls:
            return {}
        refs = list(calls.values())
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        finished, results = set(done), {}
        for i, ref in calls.items():
            handle = (handles or {}).get(i)
            if ref not in finished:
                self.lose(i, f"no answer to {what} within {timeout:g} s", handle=handle)
                continue
            try:
                results[i] = ray.get(ref)
            except (ray.exceptions.RayActorError, ServerDeadError) as e:
                self.lose(i, f"died during {what}: {_why(e)}", handle=handle)
        return results

    def each(self, method: str, timeout: float | None, only: list[bool] | None = None,
             **kwargs: Any) -> dict[int, Any]:
        """Call ``method(**kwargs)`` on every serving server (where ``only[i]``) and return the
        answers by index. A server that died, or gives no answer within ``timeout`` seconds, is
        taken out of routing and restarted (:meth:`settle`) instead of failing the caller (pause,
        resume, sleep, wake_up,
        ...)."""
        with self._lock:
            handles = {i: h for i, h in enumerate(self.group.handles)
                       if i not in self.down and (only is None or only[i])}
        calls = {i: getattr(h, method).remote(**kwargs) for i, h in handles.items()}
        return self.settle(calls, float(timeout) if timeout is not None else None, method, handles)

    def lose(self, index: int, reason: str, hung: bool = False, handle: Any = None) -> None:
        """Server ``index`` cannot serve (``reason``): out of routing and restarted where this
        manager can (:meth:`_take_out`); a restarted one that was waiting for weights is started
        again. ``hung``: its actor does not answer; it is killed without asking it to shut down,
        even where it is not restarted. ``handle``: the actor found failing; nothing is done when it
        was already replaced (by another thread)."""
        with self._lock:
            current = (
                self.restarting[index].handle
                if index in self.restarting
                else self.group.handles[index]
            )
            if handle is not None and handle is not current:
                return
            logger.warning("rollout server %d %s; it is taken out of routing", index, reason)
            if index in self.restarting:
                ray.kill(self.restarting.pop(index).handle, no_restart=True)
                if self.can_restart:
                    self._begin_restart(index)
            elif index not in self.down:
                self._take_out(index, hung)

    def _take_out(self, index: int, hung: bool = False) -> None:
        self.down.add(index)
        if self.balancer is not None:
            ray.get(self.balancer.mark_down.remote(index))
        if self.tell_down is not None:
            self.tell_down(index)
        if self.can_restart:
            self._begin_restart(index, polite=not hung)
        elif hung:  # its requests would wait on it forever: killed, they fail over
            ray.kill(self.group.handles[index], no_restart=True)
            logger.error(
                "rollout server %d hung and was killed; it cannot be restarted by "
                "this manager and stays "
                "out of routing",
                index,
            )
        else:
            logger.error(
                "rollout server %d is dead and cannot be restarted by this manager "
                "(%s servers%s); "
                "it stays out of routing",
                index,
                self.group.placement,
                "" if self.restart else ", rollout.server.restart_dead=false",
            )

    def _begin_restart(self, index: int, polite: bool = True) -> None:
        old = self.group.handles[index]
        # a hung actor cannot run its shutdown; a dead or dying one may free its engine first
        if polite:
            with contextlib.suppress(Exception):  # it is dead or dying; killing it is what matters
                ray.get(old.shutdown.remote(), timeout=10)
        ray.kill(old, no_restart=True)
        handle = self.group.relaunch(index)
        self.restarting[index] = _Restart(handle, handle.start.remote())
        slot = self.group.slots[index].facts if index < len(self.group.slots) else {}
        logger.warning(
            "rollout server %d: restarting it in its slot (%s)", index, slot or self.group.placement
        )

    def poll(self, weight_version: int, wait_s: float = 0.0) -> list[int]:
        """Put back restarted servers that finished starting (those needing weights wait for an
        update); returns the indices put back.  ``wait_s``: wait that long for pending starts (0:
        just look).
        """
        with self._lock:
            pending = {r.started: i for i, r in self.restarting.items() if not r.needs_weights}
        if not pending:
            return []
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=wait_s)
        with self._lock:
            return self._started(weight_version, [(pending[ref], ref) for ref in done])

    def _started(self, weight_version: int, done: list[tuple[int, Any]]) -> list[int]:
        back = []
        for i, ref in done:
            restart = self.restarting.get(i)
            if restart is None or restart.started is not ref or restart.needs_weights:
                continue  # another thread got there first (put it back, lost it again)
            try:
                info = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - a failed restart is retried at the next check
                logger.error(
                    "rollout server %d failed to restart: %s; trying again after the next batch", i,
                    first_line(e),
                )
                ray.kill(self.restarting.pop(i).handle, no_restart=True)
                self._begin_restart(i)
                continue
            if self.group.slots and i < len(self.group.info):
                self.group.info[i] = {**(info or {}), **self.group.slots[i].facts}
            if weight_version > 0:
                restart.needs_weights = True
                logger.warning(
                    "rollout server %d restarted with the initial weights; it "
                    "rejoins after the next "
                    "update_weights (now at version %d)",
                    i,
                    weight_version,
                )
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
