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
out finished groups as one DataProto. With ``max_staleness`` set, groups (and dispatches) that lag
the weights by more than that many versions are re-run; a dead or hung worker is replaced and its
groups re-run, at most ``agent.max_sample_retries`` times, then handed out as ``error`` rows.
:meth:`Rollouter.metrics` reports queues, staleness and the engine-busy fraction.

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
from typing import Any

import numpy as np

from agentloop.batch.metrics import align_keys
from agentloop.batch.protocol import DataProto
from agentloop.rollout.dispatcher import DispatchRun, Finished, Group, split_groups

logger = logging.getLogger(__name__)


def engine_capacity(manager: Any) -> int:
    """How many requests the manager's engines run at once: servers x ``rollout.max_num_seqs``."""
    return max(1, len(manager.server_handles) * manager.config.engine.max_num_seqs)


class Rollouter:
    """See the module docstring.

    Args:
        manager: an :class:`agentloop.rollout.manager.AgentLoopManager`.
        prompts: an iterable of prompt batches (DataProto with ``raw_prompt``; repeat them ``n``
        times with a
            shared ``uid`` first, e.g. :func:`agentloop.batch.data.repeat_for_rollout`).  Exhausting
            it ends the rollout once everything in flight is done.
        max_inflight: samples running at once (across all workers); None (default): what the engines
        run at once,
            servers x ``rollout.max_num_seqs`` (verl's fixed-size budgets leave large deployments
            idle).
        max_staleness: the most weight versions a group handed out may lag behind (None: unbounded).
        group_by: the column whose equal values form a group (None: every row is a group).
        max_queue: finished groups kept waiting for :meth:`get` before dispatching pauses.
        groups_per_dispatch: groups sent to a worker in one streaming call.
    """

    def __init__(
        self, manager: Any, prompts: Iterable[DataProto], *, max_inflight: int | None = None,
        max_staleness: int | None = None, group_by: str | None = "uid", max_queue: int = 1024,
        groups_per_dispatch: int = 4,
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
        # groups waiting to be dispatched
        self._todo: collections.deque[Group] = collections.deque()
        self._ready: queue.Queue[tuple[Group, DataProto] | None] = queue.Queue()  # (prompts, rows)
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
            prompts, rows = item
            staleness = self._staleness(rows, self.manager.weight_version)
            with self._lock:
                self._unconsumed -= 1
                # went stale while queued
                if self.max_staleness is not None and staleness > self.max_staleness:
                    self.counts["groups_rerun_stale"] += 1
                    # the thread dispatches it again (it waits for this decision)
                    self._todo.appendleft(prompts)
                    continue
            self.staleness[staleness] += 1
            self.counts["groups_handed_out"] += 1
            parts.append(rows)
        if self._error is not None:
            raise RuntimeError(f"the rollouter's thread failed: {self._error!r}") from self._error
        if not parts:
            return None
        # groups padded apart may differ in columns (a group whose samples all failed has no version
        # or reward
        # columns; loops add their own fields): aligned as generate_sequences aligns its workers'
        # chunks
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
                again = flight.take_retries()  # a dead worker's groups: dispatched again first
                self.counts["groups_rerun_fault"] += len(again)
                self._todo.extendleft(reversed(again))
                self._cancel_stale(flight)
        except BaseException as e:  # noqa: BLE001 - handed to the trainer through get()
            logger.exception("the rollouter's thread failed")
            self._error = e
        finally:
            flight.close()
            self._ready.put(None)

    def _fill(self, flight: DispatchRun) -> None:
        """Dispatch groups while fewer than ``max_inflight`` samples run and the ready queue has
        room."""
        while self._ready.qsize() < self.max_queue and flight.inflight() < self.max_inflight:
            if not self._todo and not self._exhausted:
                try:
                    batch = self.manager.prepare(next(self._prompts))
                except StopIteration:
                    self._exhausted = True
                else:
                    self._todo.extend(Group(rows, key=next(self._group_ids))
                                      for rows in split_groups(batch, self.group_by))
            if not self._todo:
                return
            groups = [self._todo.popleft()]
            while (
                self._todo
                and len(groups) < self.groups_per_dispatch
                and flight.inflight() + sum(len(g.rows) for g in groups) + len(self._todo[0].rows)
                <= self.max_inflight
            ):
                groups.append(self._todo.popleft())
            # the version this dispatch starts at; the least-loaded live worker runs it
            flight.submit(groups, global_steps=self.manager.weight_version)
            self.counts["groups_dispatched"] += len(groups)

    def _take(self, finished: Finished) -> None:
        """A group came back: queued for :meth:`get`, or (too stale) its prompts rolled out
        again."""
        rows = finished.rows
        rows.meta_info["metrics"] = finished.stats.metrics
        # the dispatcher gave up on it (its worker died, retries used): error rows
        if finished.fault:
            self.counts["groups_failed_fault"] += 1
        else:
            staleness = self._staleness(rows, finished.version)
            if self.max_staleness is not None and staleness > self.max_staleness:
                self.counts["groups_rerun_stale"] += 1
                self._todo.appendleft(finished.group)  # its prompts, rolled out again
                return
            self.counts["groups_done"] += 1
        with self._lock:
            self._unconsumed += 1
        self._ready.put((finished.group, rows))

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
