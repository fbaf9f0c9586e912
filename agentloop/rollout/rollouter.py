"""Rollouter: keeps the engines busy from a prompt iterator while the trainer trains (asynchronous
RL).

::

    # batches: a DataProto iterator; max_inflight: engines full
    rollouter = Rollouter(manager, batches, max_staleness=1)
    rollouter.start()
    for step in range(steps):
        batch = rollouter.get(num_groups=16)          # complete groups (GRPO uid), in completion
        order
        ...train on batch...
        manager.update_weights(policy.state_dict())  # generation goes on meanwhile
    rollouter.stop()

One background thread splits the prompt batches into groups (rows sharing ``group_by``) and keeps up
to ``max_inflight`` samples running through the manager's dispatcher; :meth:`Rollouter.get` hands
out finished groups as one DataProto.  With ``per_sample`` (the default without ``max_staleness``)
a group's samples are dispatched and counted one by one: a sample that ended frees its place in the
budget at once (the next samples start), while its group waits for its siblings; a group is handed
out only once all of its samples are in.  With ``max_staleness`` set, samples (and dispatches)
that lag the weights by more than that many versions are re-run, and so are the stale samples of
groups that went stale while queued; a dead or hung worker is replaced and its samples re-run, at
most ``agent.max_sample_retries`` times, then
handed out as ``error`` rows. :meth:`Rollouter.metrics` reports queues, staleness and the
engine-busy fraction.

Spec (staleness, faults, metrics): docs/async.md#the-rollouter-generation-runs-ahead-of-training.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agentloop.batch.metrics import align_keys
from agentloop.batch.protocol import DataProto
from agentloop.rollout.dispatcher import DispatchRun, Finished, Group, split_groups

logger = logging.getLogger(__name__)


def engine_capacity(manager: Any) -> int:
    """How many requests the manager's engines run at once: servers x ``rollout.max_num_seqs``."""
    return max(1, len(manager.server_handles) * manager.config.engine.max_num_seqs)


@dataclass(eq=False)
class Gathering:
    """One group coming back unit by unit: its samples (``per_sample``) or itself as one unit."""

    units: list[Group]
    """What is dispatched, in the group's row order."""
    done: dict[int, DataProto] = field(default_factory=dict)
    """Unit index -> its finished rows (``meta_info["metrics"]``: a list, one dict per row)."""
    failed: bool = False
    """A unit came back as error rows (the dispatcher gave up on it)."""

    @property
    def size(self) -> int:
        """The group's rows."""
        return sum(len(u.rows) for u in self.units)

    def complete(self) -> bool:
        """Every unit is in."""
        return len(self.done) == len(self.units)

    def rows(self) -> DataProto:
        """The group's rows in row order, ``meta_info["metrics"]`` one list over them."""
        parts = [self.done[i] for i in range(len(self.units))]
        if len(parts) == 1:
            return parts[0]
        metrics = [m for p in parts for m in p.meta_info.get("metrics") or []]
        # kept as they are: a stale unit's siblings are handed out again with its re-run
        parts = [DataProto(p.batch, p.non_tensor_batch,
                           {k: v for k, v in p.meta_info.items() if k != "metrics"})
                 for p in parts]
        out = DataProto.concat(align_keys(parts))
        out.meta_info["metrics"] = metrics
        return out


class Rollouter:
    """See the module docstring.

    Args:
        manager: an :class:`agentloop.rollout.manager.AgentLoopManager`.
        prompts: an iterable of prompt batches (DataProto with ``raw_prompt``; repeat them ``n``
            times with a shared ``uid`` first, e.g.
            :func:`agentloop.batch.data.repeat_for_rollout`).  Exhausting it ends the rollout once
            everything in flight is done.
        max_inflight: samples running at once (across all workers); None (default): what the engines
            run at once, servers x ``rollout.max_num_seqs`` (verl's fixed-size budgets leave large
            deployments idle).
        max_staleness: the most weight versions a group handed out may lag behind (None: unbounded).
        group_by: the column whose equal values form a group (None: every row is a group).
        max_queue: finished groups kept waiting for :meth:`get` before dispatching pauses.
        groups_per_dispatch: groups (their rows' worth of samples, with ``per_sample``) sent to a
            worker in one streaming call.
        per_sample: dispatch and count a group's samples one by one (a finished sample frees its
            place in ``max_inflight`` at once); False: a group is one unit whose places are held
            until its last sample ends; None (default): per sample when ``max_staleness`` is None,
            per group when it is set.
    """

    def __init__(
        self, manager: Any, prompts: Iterable[DataProto], *, max_inflight: int | None = None,
        max_staleness: int | None = None, group_by: str | None = "uid", max_queue: int = 1024,
        groups_per_dispatch: int = 4, per_sample: bool | None = None,
    ) -> None:
        if max_inflight is None:
            max_inflight = engine_capacity(manager)
        if max_inflight < 1:
            raise ValueError(f"Rollouter: max_inflight must be >= 1, got {max_inflight}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"Rollouter: max_staleness must be >= 0 or None, got {max_staleness}")
        self.manager = manager
        self._prompts: Iterator[DataProto] = iter(prompts)
        self.max_inflight = max_inflight
        self.max_staleness = max_staleness
        self.group_by = group_by
        self.max_queue = max_queue
        self.groups_per_dispatch = max(1, groups_per_dispatch)
        # measured (docs/benchmarks.md): per sample wins unbounded, loses under max_staleness=1
        self.per_sample = max_staleness is None if per_sample is None else per_sample
        # units waiting to be dispatched
        self._todo: collections.deque[Group] = collections.deque()
        self._owner: dict[Group, tuple[Gathering, int]] = {}
        """Each unit not yet in -> its group and its index there."""
        self._ready: queue.Queue[tuple[Gathering, DataProto] | None] = queue.Queue()
        self._flight: DispatchRun | None = None
        """The dispatches running (opened by the thread)."""
        self._exhausted = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._unconsumed = 0
        """Finished groups put in the ready queue and not yet handed out or re-queued by
        :meth:`get`."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._busy_at_start: list[float] = []
        self._started_at = 0.0
        self.counts = {
            "groups_dispatched": 0, "groups_done": 0, "groups_handed_out": 0,
            "groups_rerun_stale": 0, "groups_rerun_fault": 0, "groups_failed_fault": 0,
            "dispatches_cancelled_stale": 0,
        }
        self.staleness: collections.Counter[int] = collections.Counter()
        # a name per group, in the order the prompts came (for the logs)
        self._group_ids = itertools.count()

    # ----------------------------------------------------------------------------------------------
    # trainer side
    def start(self) -> Rollouter:
        """Start generating in the background; returns self."""
        if self._thread is None:
            self._busy_at_start = self.manager.engine_busy_seconds()
            # bindings of running samples are never evicted
            self.manager.grow_sticky_cache(4 * self.max_inflight)
            self._started_at = time.monotonic()
            self._thread = threading.Thread(
                target=self._run, name="agentloop-rollouter", daemon=True
            )
            self._thread.start()
        return self

    def get(self, num_groups: int = 1, timeout: float | None = None) -> DataProto | None:
        """The next ``num_groups`` finished groups as one padded DataProto (fewer when the prompts
        ran out; None when nothing is left).  Blocks until they are there (``timeout``: raise
        TimeoutError after it)."""
        self.start()
        parts: list[DataProto] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(parts) < num_groups:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                item = self._ready.get(timeout=wait)
            except queue.Empty:
                raise TimeoutError(
                    f"Rollouter.get: {len(parts)} of {num_groups} groups after {timeout}s"
                ) from None
            if item is None:  # the end
                self._ready.put(None)
                break
            gathering, rows = item
            staleness = self._staleness(rows, self.manager.weight_version)
            with self._lock:
                self._unconsumed -= 1
                # went stale while queued
                if self.max_staleness is not None and staleness > self.max_staleness:
                    self.counts["groups_rerun_stale"] += 1
                    # the thread dispatches its stale samples again (it waits for this decision)
                    self._requeue_stale(gathering, self.max_staleness)
                    continue
            self.staleness[staleness] += 1
            self.counts["groups_handed_out"] += 1
            parts.append(rows)
        if self._error is not None:
            raise RuntimeError(f"the rollouter's thread failed: {self._error!r}") from self._error
        if not parts:
            return None
        # groups padded apart may differ in columns (a group whose samples all failed has no version
        # or reward columns; loops add their own fields): aligned as generate_sequences aligns its
        # workers' chunks
        out = DataProto.concat(align_keys(parts)) if len(parts) > 1 else parts[0]
        out.meta_info["rollouter"] = self.metrics()
        return out

    def __iter__(self) -> Iterator[DataProto]:
        """Finished groups one by one until the prompts are exhausted."""
        while (group := self.get(1)) is not None:
            yield group

    def stop(self) -> None:
        """Stop dispatching, cancel what is running and end the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def metrics(self) -> dict[str, Any]:
        """Queue lengths, samples in flight, staleness histogram, re-runs and the servers' busy
        fraction."""
        wall = max(1e-9, time.monotonic() - self._started_at) if self._started_at else 0.0
        return {
            "rollouter/queue/ready_groups": self._ready.qsize(),
            "rollouter/queue/todo_groups": len(self._todo),
            "rollouter/inflight_samples": self._inflight(),
            "rollouter/engine_busy_fraction": self._busy_fraction(wall),
            "rollouter/staleness": dict(sorted(self.staleness.items())),
            **{f"rollouter/{k}": v for k, v in self.counts.items()},
        }

    # ----------------------------------------------------------------------------------------------
    # the thread
    def _inflight(self) -> int:
        return self._flight.inflight() if self._flight is not None else 0

    def _run(self) -> None:
        # no deadline: the Rollouter runs until stopped
        flight = self._flight = self.manager.workers.open()
        try:
            while not self._stop.is_set():
                # hung workers and servers, also while the trainer lets the queue fill
                flight.look_if_due()
                self._fill(flight)
                if not flight.dispatches:
                    # done once every finished group was handed out (none re-queued by get)
                    with self._lock:
                        if self._exhausted and not self._todo and self._unconsumed == 0:
                            break
                    time.sleep(0.01)  # the queue of finished groups is full: wait for the trainer
                    continue
                for finished in flight.poll(timeout=0.05):
                    self._take(finished)
                again = flight.take_retries()  # a dead worker's units: dispatched again first
                self.counts["groups_rerun_fault"] += len(again)
                self._todo.extendleft(reversed(again))
                self._cancel_stale(flight)
        except BaseException as e:  # noqa: BLE001 - handed to the trainer through get()
            logger.exception("the rollouter's thread failed")
            self._error = e
        finally:
            flight.close()
            self._ready.put(None)

    def _enqueue(self, gathering: Gathering, front: bool = False) -> None:
        """Queue every unit of ``gathering`` for dispatch (``front``: before the others)."""
        gathering.done.clear()
        gathering.failed = False
        for i, unit in enumerate(gathering.units):
            self._owner[unit] = (gathering, i)
        if front:
            self._todo.extendleft(reversed(gathering.units))
        else:
            self._todo.extend(gathering.units)

    def _requeue_stale(self, gathering: Gathering, max_staleness: int) -> None:
        """Queue again, first, the units of the finished ``gathering`` whose rows lag more than
        ``max_staleness`` versions behind (every unit when none does by itself); the rows of the
        others are kept for its next hand-out."""
        current = self.manager.weight_version
        stale = [i for i, rows in sorted(gathering.done.items())
                 if self._staleness(rows, current) > max_staleness]
        for i in stale or range(len(gathering.units)):
            gathering.done.pop(i, None)
            self._owner[gathering.units[i]] = (gathering, i)
        if not gathering.done:
            gathering.failed = False
        self._todo.extendleft(reversed([u for u in gathering.units if u in self._owner]))

    def _read_prompts(self) -> None:
        """The next prompt batch, split into groups (and those into samples) and queued."""
        try:
            batch = self.manager.prepare(next(self._prompts))
        except StopIteration:
            self._exhausted = True
            return
        for rows in split_groups(batch, self.group_by):
            key = next(self._group_ids)
            parts = split_groups(rows, None) if self.per_sample and len(rows) > 1 else [rows]
            units = [Group(p, key=key if len(parts) == 1 else (key, i))
                     for i, p in enumerate(parts)]
            self._enqueue(Gathering(units))

    def _fill(self, flight: DispatchRun) -> None:
        """Dispatch units while fewer than ``max_inflight`` samples run and the ready queue has
        room."""
        while self._ready.qsize() < self.max_queue and flight.inflight() < self.max_inflight:
            if not self._todo and not self._exhausted:
                self._read_prompts()
            if not self._todo:
                return
            units = [self._todo.popleft()]
            # at most groups_per_dispatch groups' worth of rows, within the budget
            cap = self.groups_per_dispatch * self._group_size(units[0])
            rows = len(units[0].rows)
            while (
                self._todo
                and rows + len(self._todo[0].rows) <= cap
                and flight.inflight() + rows + len(self._todo[0].rows) <= self.max_inflight
            ):
                rows += len(self._todo[0].rows)
                units.append(self._todo.popleft())
            # the version this dispatch starts at; the least-loaded live worker runs it
            flight.submit(units, global_steps=self.manager.weight_version)
            self.counts["groups_dispatched"] += sum(
                1 for u in units if self._owner[u][1] == 0
            )

    def _group_size(self, unit: Group) -> int:
        """Rows of the group ``unit`` belongs to."""
        owner = self._owner.get(unit)
        return owner[0].size if owner is not None else len(unit.rows)

    def _take(self, finished: Finished) -> None:
        """A unit came back: kept until its group is complete, then queued for :meth:`get`; too
        stale, its prompts are rolled out again."""
        rows = finished.rows
        rows.meta_info["metrics"] = finished.stats.metrics
        gathering, index = self._owner[finished.group]
        # the dispatcher gave up on it (its worker died, retries used): error rows
        if finished.fault:
            gathering.failed = True
        else:
            staleness = self._staleness(rows, finished.version)
            if self.max_staleness is not None and staleness > self.max_staleness:
                self.counts["groups_rerun_stale"] += 1
                self._todo.appendleft(finished.group)  # its prompts, rolled out again
                return
        gathering.done[index] = rows
        if not gathering.complete():
            return
        for unit in gathering.units:
            self._owner.pop(unit, None)
        self.counts["groups_failed_fault" if gathering.failed else "groups_done"] += 1
        rows = gathering.rows()
        with self._lock:
            self._unconsumed += 1
        self._ready.put((gathering, rows))

    def _staleness(self, rows: DataProto, dispatched_at: int) -> int:
        oldest = rows.non_tensor_batch.get("min_global_steps")
        versions = [
            int(v) for v in (oldest.tolist() if oldest is not None else []) if v is not None
        ]
        return max(0, self.manager.weight_version - min(versions, default=dispatched_at))

    def _cancel_stale(self, flight: DispatchRun) -> None:
        if self.max_staleness is None:
            return
        current = self.manager.weight_version
        for dispatch in flight.dispatches:
            if current - dispatch.version > self.max_staleness:
                left = flight.cancel(dispatch)
                self.counts["dispatches_cancelled_stale"] += 1
                self.counts["groups_rerun_stale"] += len(left)
                self._todo.extendleft(reversed(left))

    def _busy_fraction(self, wall: float) -> float:
        """Mean over the servers of (busy seconds since start) / wall; nan when no server can
        tell."""
        if not wall:
            return 0.0
        now = self.manager.engine_busy_seconds()
        fractions = [
            (b - a) / wall for a, b in zip(self._busy_at_start, now, strict=False) if b >= a
        ]
        return float(np.mean(fractions)) if fractions else float("nan")
