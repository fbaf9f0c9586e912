"""The AgentLoopManager's worker actors, and what happens when one dies or hangs.

:class:`WorkerPool` spreads a batch over the live AgentLoopWorker actors in contiguous row ranges and
waits for them with ``ray.wait``, so one worker's fault never costs the others' rows:

* **A worker dies** (its process crashed, was OOM-killed, or ``ray.kill``-ed): its range is split over
  the surviving workers and run again (``agent.max_sample_retries`` times at most; a sample then comes
  back as an ``error`` row naming the fault).  The dead worker's in-flight slots in the shared balancer are
  released, and a replacement actor is started at once, in the background: it joins the pool at the next
  batch that finds it ready.
* **A worker hangs** (its event loop is blocked, so even ``sample_timeout`` cannot fire): every few seconds
  of a batch each streaming worker gets a ``ping``; one that leaves it unanswered for ``agent.stall_timeout``
  seconds is killed, and handled as a dead worker (its samples re-run, or ``error`` rows saying it hung).
  With ``agent.batch_timeout`` set, each worker also cancels its own samples still running at the deadline
  (they come back as ``timeout`` rows); a worker that has not answered ``batch_grace_s`` after the deadline
  is killed and replaced, and its samples come back as ``timeout`` rows (no retry: the deadline passed).

The rows come back in the batch's order whatever happened.  ``fault_counts`` says what was done.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import ray.exceptions

from agentloop.errors import ConfigError, first_line
from agentloop.protocol import DataProto
from agentloop.types import RolloutStatus
from agentloop.utils.hangwatch import HangWatch

logger = logging.getLogger(__name__)

Spawn = Callable[[int, str], Any]
"""``spawn(slot_index, worker_id) -> actor handle``: create (not wait for) one AgentLoopWorker actor."""
ErrorRows = Callable[[DataProto, RolloutStatus, str], DataProto]
"""``error_rows(chunk, status, message)``: the padded rows of samples no worker could roll out."""


@dataclass
class _Slot:
    index: int
    handle: Any
    worker_id: str
    ready: Any = None
    """The pending ``ready()`` call of a worker still starting; None once it is serving."""
    dead: bool = False
    """Its replacement failed to start too: the slot is given up."""
    hung: str = ""
    """Why :meth:`WorkerPool.watch_workers` killed it (its death then reads as that)."""


@dataclass
class WorkerPool:
    """Worker actors with replacement; see the module docstring.

    Args:
        spawn: creates one worker actor (see :data:`Spawn`).
        num_workers: how many workers to keep.
        error_rows: builds the rows of samples that could not be rolled out.
        balancer: the GlobalBalancer actor (its slots of a dead worker are released), or None.
        max_sample_retries: how many times a sample whose worker died is run again.
        batch_timeout: seconds one ``generate_sequences`` may take (None: no deadline).
        batch_grace_s: how long after the deadline a worker may take to send its (partly timed-out) rows
            before it is considered hung and killed.
        replacement_wait_s: how long a batch waits for a replacement when no worker is left.
    """

    spawn: Spawn
    num_workers: int
    error_rows: ErrorRows
    balancer: Any = None
    max_sample_retries: int = 1
    batch_timeout: float | None = None
    batch_grace_s: float = 30.0
    replacement_wait_s: float = 300.0
    chunks_per_worker: int = 2
    """:meth:`run` cuts a batch into this many row ranges per live worker (a dead worker's unfinished ranges
    are spread over the survivors)."""
    tick: Callable[[], Any] | None = None
    """Called every ``tick_s`` seconds while a batch streams (the manager's look for hung servers and gateways)."""
    tick_s: float = 5.0
    hang_s: float | None = None
    """``agent.stall_timeout``: a streaming worker that leaves a ping unanswered this long is killed."""
    _hangs: HangWatch[int] = field(default_factory=HangWatch, repr=False)
    on_ready: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)
    """Calls made on every worker that joins later (e.g. ``attach_gateways``), in order."""
    slots: list[_Slot] = field(default_factory=list)
    fault_counts: dict[str, int] = field(default_factory=lambda: {
        "worker_restarts": 0, "sample_retries": 0, "samples_failed_by_faults": 0, "workers_hung": 0})

    def start(self) -> list[dict[str, Any]]:
        """Create every worker and wait for it to be ready; a worker that fails to start is a ConfigError
        (its ``__init__`` raised: bad tool config, parser, tokenizer...)."""
        for i in range(self.num_workers):
            worker_id = uuid.uuid4().hex
            self.slots.append(_Slot(i, self.spawn(i, worker_id), worker_id))
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
        self._poll_replacements()
        return [s.handle for s in self.slots if s.ready is None and not s.dead]

    def broadcast(self, method: str, *args: Any, remember: bool = False) -> None:
        """Call ``method(*args)`` on every serving worker and wait; ``remember``: on later joiners too."""
        if remember:
            self.on_ready.append((method, args))
        ray.get([getattr(h, method).remote(*args) for h in self.handles])

    def tell(self, method: str, *args: Any, timeout: float = 5.0) -> None:
        """Call ``method(*args)`` on every serving worker, waiting at most ``timeout`` seconds and ignoring
        failures (a note for the workers, sent from the mid-batch look, which must not wait on a hung worker)."""
        refs = [getattr(h, method).remote(*args) for h in self.handles]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout)

    # ----------------------------------------------------------------------------------------------
    def run(self, batch: DataProto) -> list[DataProto]:
        """Roll ``batch`` out over the workers; returns the outputs of contiguous row ranges in row order.

        Built on :meth:`stream`: the batch is cut into ``chunks_per_worker`` ranges per live worker, streamed,
        and the ranges put back in order, so the fault handling is the stream's (a dead worker's ranges spread
        over the survivors, a hung worker's ranges come back as timeout rows)."""
        live = self._wait_for_live_workers()
        if len(batch) == 0:  # nothing to stream: one worker pads the empty output (its columns and widths)
            return [ray.get(live[0].handle.generate_sequences.remote(batch))]
        n = max(1, min(len(live) * self.chunks_per_worker, len(batch)))
        parts = dict(self.stream(batch, [round(i * len(batch) / n) for i in range(n)]))
        return [parts[g] for g in sorted(parts)]

    def stream(self, batch: DataProto, group_starts: list[int]) -> Iterator[tuple[int, DataProto]]:
        """Roll ``batch`` out and yield ``(group, rows)`` for each group (contiguous rows from ``group_starts``) as
        soon as all its samples are done, in completion order; every group exactly once, whatever dies.  Closing
        the iterator cancels what is still running."""
        bounds = [*group_starts, len(batch)]
        live = self._wait_for_live_workers()
        deadline = time.monotonic() + self.batch_timeout if self.batch_timeout else None
        streams: dict[Any, tuple[list[int], _Slot, int]] = {}  # generator -> (its groups, worker, attempt)
        sent: set[int] = set()
        n = max(1, min(len(live), len(group_starts)))
        shares = [list(range(round(i * len(group_starts) / n), round((i + 1) * len(group_starts) / n)))
                  for i in range(n)]
        for slot, groups in zip(live, shares, strict=False):
            if groups:
                self._open_stream(batch, bounds, groups, slot, 0, deadline, streams)
        try:
            next_tick, looks = time.monotonic() + self.tick_s, self.tick is not None or self.hang_s is not None
            while streams:
                now = time.monotonic()
                if looks and now >= next_tick:
                    self.look([slot for _, slot, _ in streams.values()])
                    now = time.monotonic()
                    next_tick = now + self.tick_s
                end = None if deadline is None else deadline + self.batch_grace_s
                waits = [t - now for t in (end, next_tick if looks else None) if t is not None]
                ready, _ = ray.wait(list(streams), num_returns=1, timeout=max(0.0, min(waits)) if waits else None)
                if not ready and (end is None or time.monotonic() < end):
                    continue  # time for a tick
                if not ready:  # hung past the deadline: their groups come back as timeout rows
                    for gen, (groups, slot, _) in list(streams.items()):
                        why = f"agent.batch_timeout={self.batch_timeout}s + {self.batch_grace_s}s"
                        self._replace(slot, f"did not finish its stream within {why} (its event loop is blocked)")
                        self.fault_counts["workers_hung"] += 1
                        for g in groups:
                            if g not in sent:
                                sent.add(g)
                                self.fault_counts["samples_failed_by_faults"] += bounds[g + 1] - bounds[g]
                                yield g, self.error_rows(batch.slice(bounds[g], bounds[g + 1]), RolloutStatus.TIMEOUT,
                                                         "the agent-loop worker running this sample hung past "
                                                         f"agent.batch_timeout={self.batch_timeout}s and was restarted "
                                                         "(a tool or loop blocking its event loop? run blocking "
                                                         "code in a thread)")
                        del streams[gen]
                    break
                gen = ready[0]
                groups, slot, attempt = streams[gen]
                try:
                    local, rows = ray.get(next(gen))  # type: ignore[call-overload,arg-type]
                except StopIteration:
                    del streams[gen]
                    continue
                except ray.exceptions.RayActorError as e:
                    del streams[gen]
                    why = slot.hung or first_line(e)
                    self._replace(slot, f"died while streaming groups {groups[:5]}...: {why}")
                    left = [g for g in groups if g not in sent]
                    yield from self._restream(batch, bounds, left, attempt, why, deadline, streams, sent)
                    continue
                sent.add(groups[local])
                yield groups[local], rows
        finally:
            for gen in streams:
                ray.cancel(gen)

    def _open_stream(self, batch: DataProto, bounds: list[int], groups: list[int], slot: _Slot, attempt: int,
                     deadline: float | None, streams: dict[Any, tuple[list[int], _Slot, int]]) -> None:
        rows = np.concatenate([np.arange(bounds[g], bounds[g + 1]) for g in groups])
        sizes = [bounds[g + 1] - bounds[g] for g in groups]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist()
        timeout = None if deadline is None else max(0.001, deadline - time.monotonic())
        gen = slot.handle.generate_sequences_stream.options(num_returns="streaming").remote(
            batch.select_idxs(rows), starts, timeout=timeout)
        streams[gen] = (groups, slot, attempt)

    def _restream(self, batch: DataProto, bounds: list[int], groups: list[int], attempt: int, reason: str,
                  deadline: float | None, streams: dict[Any, tuple[list[int], _Slot, int]],
                  sent: set[int]) -> Iterator[tuple[int, DataProto]]:
        """A dead worker's unfinished groups: streamed again by the live workers, or error rows."""
        if not groups:
            return
        out_of_time = deadline is not None and time.monotonic() >= deadline
        live = [] if out_of_time or attempt >= self.max_sample_retries else self._wait_for_live_workers(False)
        if not live:
            why = ("the batch deadline passed" if out_of_time else
                   f"agent.max_sample_retries={self.max_sample_retries} retries were used"
                   if attempt >= self.max_sample_retries else "no agent-loop worker is left")
            for g in groups:
                sent.add(g)
                self.fault_counts["samples_failed_by_faults"] += bounds[g + 1] - bounds[g]
                yield g, self.error_rows(batch.slice(bounds[g], bounds[g + 1]), RolloutStatus.ERROR,
                                         f"the agent-loop worker running this sample died ({reason}) and {why}")
            return
        self.fault_counts["sample_retries"] += sum(bounds[g + 1] - bounds[g] for g in groups)
        n = min(len(live), len(groups))
        for i, slot in enumerate(live[:n]):
            share = groups[round(i * len(groups) / n):round((i + 1) * len(groups) / n)]
            self._open_stream(batch, bounds, share, slot, attempt + 1, deadline, streams)

    def look(self, slots: list[_Slot]) -> None:
        """The periodic look while samples run: hung workers among ``slots`` (:meth:`watch_workers`), then the
        manager's :attr:`tick` (hung servers and gateways)."""
        if self.hang_s is not None:
            self.watch_workers(slots)
        if self.tick is not None:
            self.tick()

    def watch_workers(self, slots: list[_Slot]) -> list[_Slot]:
        """Ping each worker in ``slots`` (one ping in flight per worker; never waits).  A worker whose ping is
        unanswered after ``hang_s`` seconds has a blocked event loop (a loop or tool running blocking code):
        it is killed, so its streams end with an actor error and the caller re-runs its samples as for a dead
        worker.  Returns the workers killed."""
        hang_s = float(self.hang_s or 0)
        watched = {s.index: s for s in slots if s.ready is None and not s.dead and not s.hung}
        hung, _ = self._hangs.look({i: s.handle for i, s in watched.items()}, lambda h: h.ping.remote(), hang_s)
        for index in hung:  # a death is left to the stream, which reports it
            slot = watched[index]
            slot.hung = (f"hung: a ping went unanswered for {hang_s:g} s (agent.stall_timeout), so its event "
                         "loop is blocked (a loop or tool running blocking code? run it in a thread)")
            logger.warning("agent-loop worker %d %s; killing it", slot.index, slot.hung)
            ray.kill(slot.handle, no_restart=True)
            self.fault_counts["workers_hung"] += 1
        return [watched[i] for i in hung]

    # ----------------------------------------------------------------------------------------------
    def _replace(self, slot: _Slot, reason: str) -> None:
        """Kill a dead or hung worker, release its balancer slots and start its replacement (not awaited)."""
        if slot.ready is not None or slot.dead:
            return  # already being replaced
        logger.warning("agent-loop worker %d %s; releasing its server slots and starting a replacement",
                       slot.index, reason)
        ray.kill(slot.handle, no_restart=True)
        if self.balancer is not None:
            self.balancer.release_owner.remote(slot.worker_id)
        slot.worker_id, slot.hung = uuid.uuid4().hex, ""
        slot.handle = self.spawn(slot.index, slot.worker_id)
        slot.ready = slot.handle.ready.remote()
        self.fault_counts["worker_restarts"] += 1

    def _poll_replacements(self, timeout: float = 0.0) -> None:
        starting = {s.ready: s for s in self.slots if s.ready is not None and not s.dead}
        if not starting:
            return
        done, _ = ray.wait(list(starting), num_returns=len(starting), timeout=timeout)
        for ref in done:
            slot = starting[ref]
            try:
                ray.get(ref)
                for method, args in self.on_ready:
                    ray.get(getattr(slot.handle, method).remote(*args))
            except Exception as e:  # noqa: BLE001 - a replacement that cannot start: give the slot up
                logger.error("the replacement of agent-loop worker %d failed to start: %s; running with one worker "
                             "fewer", slot.index, first_line(e))
                slot.dead = True
            slot.ready = None

    def _wait_for_live_workers(self, must: bool = True) -> list[_Slot]:
        """The serving workers; with none, waits up to ``replacement_wait_s`` for a replacement."""
        self._poll_replacements()
        live = [s for s in self.slots if s.ready is None and not s.dead]
        if live or not any(s.ready is not None and not s.dead for s in self.slots):
            if not live and must:
                raise RuntimeError("every agent-loop worker is gone and none could be restarted (see the log)")
            return live
        self._poll_replacements(self.replacement_wait_s)
        live = [s for s in self.slots if s.ready is None and not s.dead]
        if not live and must:
            raise RuntimeError(f"no agent-loop worker became ready within {self.replacement_wait_s}s of a restart")
        return live

    def shutdown(self) -> None:
        """Kill every worker."""
        for slot in self.slots:
            ray.kill(slot.handle)
        self.slots = []
