"""The AgentLoopWorker actors behind the dispatcher: started, watched, replaced.

:class:`WorkerSlots` keeps ``num_workers`` worker actors, one per slot:

* **A worker dies** (its process crashed, was OOM-killed, or ``ray.kill``-ed) or is found hung:
  :meth:`replace` kills it, releases its in-flight slots in the shared balancer and starts a
  replacement in the background; the replacement serves once its ``ready()`` answered
  (:meth:`poll_replacements`), after the calls every joiner gets (``on_ready``, e.g.
  ``attach_gateways``).  A replacement that cannot start gives its slot up.
* **A worker hangs** (its event loop is blocked): :meth:`watch` pings each streaming worker (one
  ping in flight each) and kills one that leaves it unanswered for ``hang_s`` seconds
  (``agent.stall_timeout``); its streams then end with an actor error, which the dispatcher handles
  as a death.

What the samples of a dead worker become is the dispatcher's (:mod:`agentloop.rollout.dispatcher`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
import ray.exceptions

from agentloop.errors import ConfigError, first_line
from agentloop.utils.hangwatch import HangWatch

logger = logging.getLogger(__name__)

Spawn = Callable[[int, str], Any]
"""``spawn(slot_index, worker_id) -> actor handle``: create (not wait for) one AgentLoopWorker
actor."""


def fresh_fault_counts() -> dict[str, int]:
    """The cumulative fault counters of a pool (``agent_loop/faults/*`` reports their change per
    batch)."""
    return {
        "worker_restarts": 0, "sample_retries": 0, "samples_failed_by_faults": 0, "workers_hung": 0,
    }


@dataclass
class WorkerSlot:
    """One worker place: the actor serving it now (or its replacement while that starts)."""

    index: int
    handle: Any
    worker_id: str
    ready: Any = None
    """The pending ``ready()`` call of a worker still starting; None once it is serving."""
    dead: bool = False
    """Its replacement failed to start too: the slot is given up."""
    hung: str = ""
    """Why :meth:`WorkerSlots.watch` killed it (its death then reads as that)."""

    @property
    def serving(self) -> bool:
        """Started and not given up."""
        return self.ready is None and not self.dead

    @property
    def starting(self) -> bool:
        """A replacement still starting."""
        return self.ready is not None and not self.dead


@dataclass
class WorkerSlots:
    """Worker actors with replacement; see the module docstring.

    Args:
        spawn: creates one worker actor (see :data:`Spawn`).
        num_workers: how many workers to keep.
        balancer: the GlobalBalancer actor (its slots of a dead worker are released), or None.
        hang_s: ``agent.stall_timeout``: a streaming worker that leaves a ping unanswered this long
        is killed. replacement_wait_s: how long :meth:`live` waits for a replacement when no worker
        is left. fault_counts: the counters to add ``worker_restarts`` / ``workers_hung`` to.
    """

    spawn: Spawn
    num_workers: int
    balancer: Any = None
    hang_s: float | None = None
    replacement_wait_s: float = 300.0
    fault_counts: dict[str, int] = field(default_factory=fresh_fault_counts)
    on_ready: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)
    """Calls made on every worker that joins later (e.g. ``attach_gateways``), in order."""
    slots: list[WorkerSlot] = field(default_factory=list)
    hangs: HangWatch[int] = field(default_factory=HangWatch, repr=False)
    """The pings in flight (:meth:`watch`)."""

    def start(self) -> list[dict[str, Any]]:
        """Create every worker and wait for it; returns their ``ready()`` infos.

        Raises:
            ConfigError: a worker failed to start (its ``__init__`` raised: bad tool config, parser,
            ...).
        """
        for i in range(self.num_workers):
            worker_id = uuid.uuid4().hex
            self.slots.append(WorkerSlot(i, self.spawn(i, worker_id), worker_id))
        try:
            return ray.get([s.handle.ready.remote() for s in self.slots])
        except ray.exceptions.ActorDiedError as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            raise ConfigError(
                f"an agent-loop worker failed to start: {lines[-1] if lines else e!r} "
                "(the worker's full traceback is in the log above)"
            ) from e

    @property
    def handles(self) -> list[Any]:
        """The serving workers' handles (replacements still starting are left out)."""
        self.poll_replacements()
        return [s.handle for s in self.slots if s.serving]

    def broadcast(self, method: str, *args: Any, remember: bool = False) -> None:
        """Call ``method(*args)`` on every serving worker and wait; ``remember``: on later
        joiners too."""
        if remember:
            self.on_ready.append((method, args))
        ray.get([getattr(h, method).remote(*args) for h in self.handles])

    def tell(self, method: str, *args: Any, timeout: float = 5.0) -> None:
        """Call ``method(*args)`` on every serving worker, waiting at most ``timeout`` seconds and
        ignoring failures (a note sent from the mid-batch look, which must not wait on a hung
        worker)."""
        refs = [getattr(h, method).remote(*args) for h in self.handles]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout)

    def live(self, must: bool = True) -> list[WorkerSlot]:
        """The serving workers; with none, waits up to ``replacement_wait_s`` for a replacement.

        Raises:
            RuntimeError: ``must`` and no worker serves (none left, or none became ready in time).
        """
        self.poll_replacements()
        live = [s for s in self.slots if s.serving]
        if live or not any(s.starting for s in self.slots):
            if not live and must:
                raise RuntimeError(
                    "every agent-loop worker is gone and none could be restarted (see the log)"
                )
            return live
        self.poll_replacements(self.replacement_wait_s)
        live = [s for s in self.slots if s.serving]
        if not live and must:
            raise RuntimeError(
                f"no agent-loop worker became ready within {self.replacement_wait_s}s of a restart"
            )
        return live

    def poll_replacements(self, timeout: float = 0.0) -> None:
        """Let replacements that finished starting (within ``timeout`` seconds) serve; give up
        those that failed."""
        starting = {s.ready: s for s in self.slots if s.starting}
        if not starting:
            return
        done, _ = ray.wait(list(starting), num_returns=len(starting), timeout=timeout)
        for ref in done:
            slot = starting[ref]
            try:
                ray.get(ref)
                for method, args in self.on_ready:
                    ray.get(getattr(slot.handle, method).remote(*args))
            # a replacement that cannot start: give the slot up
            except Exception as e:  # noqa: BLE001
                logger.error(
                    "the replacement of agent-loop worker %d failed to start: %s; "
                    "running with one worker "
                    "fewer",
                    slot.index,
                    first_line(e),
                )
                slot.dead = True
            slot.ready = None

    def replace(self, slot: WorkerSlot, reason: str, handle: Any = None) -> None:
        """Kill a dead or hung worker, release its balancer slots and start its replacement (not
        awaited); a slot already being replaced (or given up), or no longer running ``handle`` (the
        actor found dead), is left as it is."""
        if (
            slot.ready is not None
            or slot.dead
            or (handle is not None and handle is not slot.handle)
        ):
            return
        logger.warning(
            "agent-loop worker %d %s; releasing its server slots and starting a replacement",
            slot.index, reason,
        )
        ray.kill(slot.handle, no_restart=True)
        if self.balancer is not None:
            self.balancer.release_owner.remote(slot.worker_id)
        slot.worker_id, slot.hung = uuid.uuid4().hex, ""
        slot.handle = self.spawn(slot.index, slot.worker_id)
        slot.ready = slot.handle.ready.remote()
        self.fault_counts["worker_restarts"] += 1

    def watch(self, slots: list[WorkerSlot]) -> list[WorkerSlot]:
        """Ping each worker in ``slots`` (one ping in flight per worker; never waits); kill the ones
        whose ping has been unanswered for ``hang_s`` seconds (their event loop is blocked). Returns
        the workers killed."""
        hang_s = float(self.hang_s or 0)
        watched = {s.index: s for s in slots if s.serving and not s.hung}
        hung, _ = self.hangs.look(
            {i: s.handle for i, s in watched.items()}, lambda h: h.ping.remote(), hang_s
        )
        for index in hung:  # a death is left to the stream, which reports it
            slot = watched[index]
            slot.hung = (
                f"hung: a ping went unanswered for {hang_s:g} s "
                f"(agent.stall_timeout), so its event "
                "loop is blocked (a loop or tool running blocking code? run it in "
                "a thread)"
            )
            logger.warning("agent-loop worker %d %s; killing it", slot.index, slot.hung)
            ray.kill(slot.handle, no_restart=True)
            self.fault_counts["workers_hung"] += 1
        return [watched[i] for i in hung]

    def shutdown(self) -> None:
        """Kill every worker."""
        for slot in self.slots:
            ray.kill(slot.handle)
        self.slots = []
