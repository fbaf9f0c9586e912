"""The one dispatcher: groups of rows out to the AgentLoopWorkers, their padded rows back, whatever
a worker does.

:class:`Dispatcher` owns the worker actors (:mod:`agentloop.rollout.worker_slots`) and every way
rows travel to them; ``generate_sequences`` (:meth:`Dispatcher.run`), ``generate_sequences_stream``
(:meth:`Dispatcher.stream`) and the Rollouter (a :class:`DispatchRun` it keeps filling) use it, so a
fault is handled by one piece of code (:meth:`DispatchRun.poll`): a dead or hung worker is replaced
and its unfinished groups are rolled out again, each at most ``agent.max_sample_retries`` times,
then come back as ``error`` rows saying why; past ``agent.batch_timeout`` plus ``batch_grace_s``, a
silent worker's groups are ``timeout`` rows. Every group comes back exactly once; ``fault_counts``
says what was done.  The behaviour in full: docs/faults.md.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import ray.exceptions

from agentloop.batch.protocol import DataProto
from agentloop.errors import first_line
from agentloop.rollout.dispatch_channel import ChannelPolling
from agentloop.rollout.dispatch_parts import Dispatch, Finished, Group, split_groups
from agentloop.rollout.result_channel import ResultChannel
from agentloop.rollout.worker import WorkerStats
from agentloop.rollout.worker_slots import Spawn, WorkerSlot, WorkerSlots, fresh_fault_counts
from agentloop.types import RolloutStatus

__all__ = [
    "Dispatch", "DispatchRun", "Dispatcher", "ErrorRows", "Finished", "Group", "split_groups",
]

CONNECT_WAIT_S = 10.0
"""How long :meth:`Dispatcher.start` waits for the workers' hellos on the result channel."""

ErrorRows = Callable[[DataProto, RolloutStatus, str], DataProto]
"""``error_rows(chunk, status, message)``: the padded rows of samples no worker could roll out."""


@dataclass
class Dispatcher:
    """Worker actors and the dispatch of rows to them (see the module docstring).

    Args:
        spawn: creates one worker actor (:data:`~agentloop.rollout.worker_slots.Spawn`).
        num_workers: how many workers to keep.
        error_rows: builds the rows of samples that could not run (:data:`ErrorRows`).
        balancer: the GlobalBalancer actor (a dead worker's slots are released there), or None.
        max_sample_retries: re-runs of a group whose worker died.
        batch_timeout: seconds one :meth:`run` / :meth:`stream` may take (None: no deadline); a
        worker
            still sending rows ``batch_grace_s`` seconds after it is killed.
        replacement_wait_s: seconds to wait for a replacement when no worker is left.
        chunks_per_worker: row ranges per live worker that :meth:`run` cuts a batch into.
        tick, tick_s: ``tick()`` runs every ``tick_s`` seconds while rows stream, after the look for
        hung workers. hang_s: ``agent.stall_timeout``: a streaming worker leaving a ping unanswered
        this long is killed. weight_version: the weight version the servers serve (recorded per
        dispatch). result_channel: ``agent.result_channel``: ``tcp`` (rows come back on a
        :class:`~agentloop.rollout.result_channel.ResultChannel` opened by :meth:`start`) or
        ``ray`` (as the stream's items).

    Spec: docs/async.md#streaming-complete-groups, docs/faults.md.
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
    tick: Callable[[], Any] | None = None
    tick_s: float = 5.0
    hang_s: float | None = None
    weight_version: Callable[[], int] = lambda: 0
    fault_counts: dict[str, int] = field(default_factory=fresh_fault_counts)
    result_channel: str = "ray"
    pool: WorkerSlots = field(init=False, repr=False)
    channel: ResultChannel | None = field(default=None, init=False, repr=False)
    tokens: Iterator[int] = field(default_factory=lambda: itertools.count(1), repr=False)
    """Result-channel tokens, one per dispatch (0 is a connection's hello)."""

    def __post_init__(self) -> None:
        self.pool = WorkerSlots(
            self.spawn, self.num_workers, self.balancer, self.hang_s, self.replacement_wait_s,
            fault_counts=self.fault_counts,
        )

    # ----------------------------------------------------------------------------------------------
    # the workers
    def start(self) -> list[dict[str, Any]]:
        """Start every worker and wait for it (:meth:`WorkerSlots.start`; a failed start is a
        ConfigError); with ``result_channel: tcp``, opens the channel and connects every worker
        (and every later one) to it."""
        infos = self.pool.start()
        if self.result_channel == "tcp":
            self.channel = ResultChannel()
            endpoint = self.channel.endpoint
            self.pool.on_ready.append(("connect_results", endpoint))
            slots = self.pool.live(must=False)
            joined = ray.get([s.handle.connect_results.remote(*endpoint) for s in slots])
            ids = [s.worker_id for s, ok in zip(slots, joined, strict=True) if ok]
            if not ids:  # unreachable from the workers: no replacement waits on it either
                self.pool.on_ready.remove(("connect_results", endpoint))
                self.channel.close()
                self.channel = None
            else:
                self.channel.wait_connected(ids, CONNECT_WAIT_S)
        return infos

    @property
    def handles(self) -> list[Any]:
        """The serving workers' handles."""
        return self.pool.handles

    @property
    def slots(self) -> list[WorkerSlot]:
        """Every worker place, serving or not."""
        return self.pool.slots

    def broadcast(self, method: str, *args: Any, remember: bool = False) -> None:
        """:meth:`WorkerSlots.broadcast`: ``method(*args)`` on every serving worker
        (``remember``: joiners too)."""
        self.pool.broadcast(method, *args, remember=remember)

    def tell(self, method: str, *args: Any, timeout: float = 5.0) -> None:
        """:meth:`WorkerSlots.tell`: ``method(*args)`` on every serving worker, not waiting past
        ``timeout``."""
        self.pool.tell(method, *args, timeout=timeout)

    def live_workers(self, must: bool = True) -> list[WorkerSlot]:
        """The serving workers (waits for a replacement when none is left;
        :meth:`WorkerSlots.live`)."""
        return self.pool.live(must)

    def poll_replacements(self, timeout: float = 0.0) -> None:
        """Let replacements that started within ``timeout`` seconds serve."""
        self.pool.poll_replacements(timeout)

    def replace_worker(self, slot: WorkerSlot, reason: str, handle: Any = None) -> None:
        """Kill a dead or hung worker and start its replacement (:meth:`WorkerSlots.replace`;
        ``handle``: the actor found dead, so a slot that already runs its replacement is left
        alone)."""
        self.pool.replace(slot, reason, handle)

    def watch_workers(self, slots: list[WorkerSlot]) -> list[WorkerSlot]:
        """Kill the workers among ``slots`` whose event loop is blocked
        (:meth:`WorkerSlots.watch`)."""
        return self.pool.watch(slots)

    def look(self, slots: list[WorkerSlot]) -> None:
        """The periodic look while rows stream: hung workers among ``slots``, then :attr:`tick`."""
        if self.hang_s is not None:
            self.watch_workers(slots)
        if self.tick is not None:
            self.tick()

    def shutdown(self) -> None:
        """Kill every worker (and close the result channel)."""
        self.pool.shutdown()
        if self.channel is not None:
            self.channel.close()

    # ---- dispatch ------------------------------------------------------------------------------
    def fail(self, group: Group, status: RolloutStatus, message: str, version: int) -> Finished:
        """``group`` as rows of ``status`` saying ``message`` (counted in
        ``samples_failed_by_faults``)."""
        self.fault_counts["samples_failed_by_faults"] += len(group.rows)
        rows = self.error_rows(group.rows, status, message)
        return Finished(group, rows, WorkerStats.take(rows), version, fault=message)

    def open(
        self, deadline: float | None = None, on_last: Callable[[], Any] | None = None
    ) -> DispatchRun:
        """A new set of dispatches (``deadline``: ``time.monotonic()`` by which their samples
        must be done; ``on_last``: see :meth:`run`)."""
        return DispatchRun(self, deadline, on_last)

    def stream(
        self, groups: list[Group], global_steps: int | None = None,
        on_last: Callable[[], Any] | None = None,
    ) -> Iterator[Finished]:
        """Roll ``groups`` out over the live workers; yields each as soon as all its samples are
        done, in completion order, exactly once whatever dies.  Closing the iterator cancels what is
        still running. ``on_last``: see :meth:`run`."""
        deadline = time.monotonic() + self.batch_timeout if self.batch_timeout else None
        run = self.open(deadline, on_last)
        try:
            run.spread(groups, global_steps)
            while run.dispatches or run.retry:
                if run.retry:
                    run.spread(run.take_retries(), global_steps)
                yield from run.poll()
        finally:
            run.close()

    def run(
        self, batch: DataProto, on_last: Callable[[], Any] | None = None,
        on_part: Callable[[int, Finished], Any] | None = None,
    ) -> list[Finished]:
        """Roll ``batch`` out in ``chunks_per_worker`` row ranges per live worker; returns the
        ranges in row order (the fault handling is :meth:`stream`'s). ``on_part(first_row,
        finished)`` is called as each range comes back, with the range's first input row.

        ``on_last()`` is called when only one group is left out, and again once its rows are
        ready (before they are fetched) unless the first call is under :data:`ON_LAST_FRESH_S`
        old: the manager sends its servers' health probes then, so their round trip overlaps the
        wait and the transfer.  Called again at the end if a fault made groups run again after it.
        """
        n = max(1, min(len(self.live_workers()) * self.chunks_per_worker, len(batch)))
        bounds = [round(i * len(batch) / n) for i in range(n)] + [len(batch)]
        groups = [Group(batch.slice(bounds[i], bounds[i + 1]), key=i) for i in range(n)]
        fired: list[dict[str, int]] = []

        def last() -> None:
            fired.append(dict(self.fault_counts))
            if on_last is not None:
                on_last()

        parts: dict[int, Finished] = {}
        for f in self.stream(groups, on_last=last):
            parts[f.group.key] = f
            if on_part is not None:
                on_part(bounds[f.group.key], f)
        if on_last is not None and (not fired or fired[-1] != self.fault_counts):
            on_last()  # never fired, or faults after it: the servers are probed again now
        return [parts[k] for k in sorted(parts)]


ON_LAST_FRESH_S = 0.1
"""How old :class:`DispatchRun`'s first ``on_last`` call (one group left out) may be when that
group is ready for it to stand for the last one: in a batch whose groups finish together the
servers' health probes then come back while the last group is still on its way (issue 33: about
0.6 ms of the 8 ms after the last sample on a 2-core host); later, they are sent again."""


class DispatchRun(ChannelPolling):
    """Dispatches in flight, polled by one thread (a batch of the manager's, or the Rollouter's)."""

    def __init__(
        self, dispatcher: Dispatcher, deadline: float | None = None,
        on_last: Callable[[], Any] | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.deadline = deadline
        self.on_last = on_last
        """Called when only one group is left out (its round trip overlaps the wait for it), and
        again when that group is ready, before it is fetched, unless the first call is less than
        :data:`ON_LAST_FRESH_S` old."""
        self.on_last_at: float | None = None
        self.open: dict[Any, Dispatch] = {}  # streaming generator -> its dispatch
        self.by_token: dict[int, Dispatch] = {}  # result-channel token -> its dispatch
        self.retry: list[Group] = []
        """Groups of dead workers to roll out again (:meth:`take_retries`)."""
        self.next_look = time.monotonic() + dispatcher.tick_s

    @property
    def dispatches(self) -> list[Dispatch]:
        """The dispatches still streaming."""
        return list(self.open.values())

    def _left(self) -> int:
        """Groups sent and not yet returned."""
        return sum(len(d.groups) - len(d.finished) for d in self.open.values())

    def inflight(self) -> int:
        """Samples sent and not yet returned."""
        return sum(len(g.rows) for d in self.dispatches for g in d.unfinished())

    def take_retries(self) -> list[Group]:
        """The groups to roll out again, handed to the caller (who submits them)."""
        groups, self.retry = self.retry, []
        return groups

    def submit(
        self, groups: list[Group], slot: WorkerSlot | None = None, global_steps: int | None = None
    ) -> Dispatch:
        """Send ``groups`` to one worker in one streaming call: ``slot``, else the live worker with
        the fewest samples in flight.  ``global_steps``: the version the rows record (default: their
        batch's).
        """
        if slot is None:
            load: dict[int, int] = {}
            for d in self.dispatches:
                load[id(d.slot)] = load.get(id(d.slot), 0) + sum(
                    len(g.rows) for g in d.unfinished()
                )
            slot = min(self.dispatcher.live_workers(), key=lambda s: load.get(id(s), 0))
        sizes = [len(g.rows) for g in groups]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist()
        batch = DataProto.concat([g.rows for g in groups]) if len(groups) > 1 else groups[0].rows
        if global_steps is not None:
            batch = DataProto(
                batch.batch, batch.non_tensor_batch,
                {**batch.meta_info, "global_steps": global_steps},
            )
        timeout = None if self.deadline is None else max(0.001, self.deadline - time.monotonic())
        channel = self.dispatcher.channel
        if channel is not None and channel.closed:  # its reader stopped: through the streams
            channel = None
        token = None if channel is None else next(self.dispatcher.tokens)
        extra = {} if token is None else {"channel_token": token}
        ref = slot.handle.generate_sequences_stream.options(num_returns="streaming").remote(
            batch, starts, timeout=timeout, encoded=True, **extra
        )
        dispatch = Dispatch(groups, slot, slot.handle, ref, self.dispatcher.weight_version(),
                            token=token, worker_id=slot.worker_id)
        self.open[ref] = dispatch
        if channel is not None and token is not None:
            channel.expect(token)
            self.by_token[token] = dispatch
        return dispatch

    def _drop(self, dispatch: Dispatch) -> None:
        """``dispatch`` is no longer waited for (done, dead, cancelled)."""
        self.open.pop(dispatch.ref, None)
        if dispatch.token is not None and self.by_token.pop(dispatch.token, None) is not None:
            assert self.dispatcher.channel is not None
            self.dispatcher.channel.forget(dispatch.token)

    def spread(self, groups: list[Group], global_steps: int | None = None) -> None:
        """Send ``groups`` over the live workers in contiguous shares, one dispatch each."""
        if not groups:
            return
        live = self.dispatcher.live_workers()
        n = max(1, min(len(live), len(groups)))
        for i, slot in enumerate(live[:n]):
            share = groups[round(i * len(groups) / n):round((i + 1) * len(groups) / n)]
            if share:
                self.submit(share, slot, global_steps)

    def cancel(self, dispatch: Dispatch) -> list[Group]:
        """Stop ``dispatch`` (its engine requests are aborted); returns its unfinished groups."""
        ray.cancel(dispatch.ref)
        self._drop(dispatch)
        return dispatch.unfinished()

    def close(self) -> None:
        """Cancel every dispatch still streaming."""
        for dispatch in list(self.open.values()):
            ray.cancel(dispatch.ref)
            self._drop(dispatch)

    def look_if_due(self) -> None:
        """The dispatcher's periodic look (hung workers among these dispatches', then its ``tick``),
        every ``tick_s`` seconds."""
        if time.monotonic() >= self.next_look:
            self.dispatcher.look([x.slot for x in self.dispatches])
            self.next_look = time.monotonic() + self.dispatcher.tick_s

    def poll(self, timeout: float | None = None) -> list[Finished]:
        """Wait up to ``timeout`` seconds (None: until something happens) for the next result;
        returns the groups finished by it: rolled out, or given up on.  Dead workers' groups to try
        again go to :attr:`retry`; the periodic look runs when due."""
        d = self.dispatcher
        self.look_if_due()
        now = time.monotonic()
        end = None if self.deadline is None else self.deadline + d.batch_grace_s
        waits = [
            t - now
            for t in (end, self.next_look if d.tick or d.hang_s is not None else None)
            if t is not None
        ]
        if timeout is not None:
            waits.append(timeout)
        if not self.open:
            return []
        if self.by_token:
            return self._poll_channel(waits, end)
        ready, _ = ray.wait(
            list(self.open), num_returns=1, timeout=max(0.0, min(waits)) if waits else None
        )
        if ready:
            return self._take(self.open[ready[0]])
        if end is not None and time.monotonic() >= end:
            return self._hung_past_deadline()
        return []

    def _take(
        self, dispatch: Dispatch, fetch: Callable[[], list[Finished]] | None = None
    ) -> list[Finished]:
        if self.on_last is not None and not self.retry and self._left() == 1:
            on_last = self.on_last
            self.on_last = None
            if self.on_last_at is None or time.monotonic() - self.on_last_at > ON_LAST_FRESH_S:
                on_last()
        finished = self._fetch(dispatch) if fetch is None else fetch()
        if (
            finished and self.on_last is not None and self.on_last_at is None
            and not self.retry and self._left() == 1
        ):
            self.on_last_at = time.monotonic()
            self.on_last()
        return finished

    def _fetch(self, dispatch: Dispatch) -> list[Finished]:
        try:
            local, rows, stats = ray.get(next(dispatch.ref))
        except StopIteration:
            if dispatch.token is not None and dispatch.unfinished():
                dispatch.ended_at = time.monotonic()  # its last frames are on the way
            else:
                self._drop(dispatch)
            return []
        except ray.exceptions.RayActorError as e:
            self._drop(dispatch)
            return self._lost(dispatch, dispatch.slot.hung or first_line(e))
        return self._finish(dispatch, local, rows, stats)

    def _finish(
        self, dispatch: Dispatch, local: int, rows: DataProto, stats: WorkerStats
    ) -> list[Finished]:
        """Group ``local`` of ``dispatch`` is back (from its stream or its channel frame)."""
        if local in dispatch.finished:
            return []
        dispatch.finished.add(local)
        if len(dispatch.finished) == len(dispatch.groups):
            # every group is in: no round trip to learn that the stream ended (its end is left to
            # Ray; nothing is cancelled)
            self._drop(dispatch)
        group = dispatch.groups[local]
        group.retries = 0
        return [Finished(group, rows, stats, dispatch.version)]

    def _lost(self, dispatch: Dispatch, why: str) -> list[Finished]:
        """A dead worker's unfinished groups: to :attr:`retry`, or error rows when they cannot be
        retried."""
        d = self.dispatcher
        left = dispatch.unfinished()
        d.replace_worker(
            dispatch.slot, f"died while streaming groups {[g.key for g in left[:5]]}...: {why}",
            dispatch.handle,
        )
        out_of_time = self.deadline is not None and time.monotonic() >= self.deadline
        retry = [g for g in left if g.retries < d.max_sample_retries]
        # waits for a replacement
        no_worker = bool(retry) and not out_of_time and not d.live_workers(must=False)
        failed: list[Finished] = []
        for group in left:
            if out_of_time:
                reason = "the batch deadline passed"
            elif group.retries >= d.max_sample_retries:
                reason = f"agent.max_sample_retries={d.max_sample_retries} retries were used"
            elif no_worker:
                reason = "no agent-loop worker is left"
            else:
                group.retries += 1
                d.fault_counts["sample_retries"] += len(group.rows)
                self.retry.append(group)
                continue
            failed.append(
                d.fail(
                    group, RolloutStatus.ERROR,
                    f"the agent-loop worker running this sample died ({why}) and {reason}",
                    dispatch.version,
                )
            )
        return failed

    def _hung_past_deadline(self) -> list[Finished]:
        """Workers that sent nothing by the deadline + grace: killed and replaced, their groups
        timeout rows."""
        d, failed = self.dispatcher, []
        why = f"agent.batch_timeout={d.batch_timeout}s + {d.batch_grace_s}s"
        for dispatch in self.dispatches:
            d.replace_worker(
                dispatch.slot,
                f"did not finish its stream within {why} (its event loop is blocked)",
                dispatch.handle,
            )
            d.fault_counts["workers_hung"] += 1
            for group in dispatch.unfinished():
                failed.append(
                    d.fail(
                        group,
                        RolloutStatus.TIMEOUT,
                        "the agent-loop worker "
                        "running this sample hung "
                        f"past agent.batch_timeout={d.batch_timeout}s and was "
                        f"restarted (a tool or "
                        "loop blocking its event loop? run blocking code in a "
                        "thread)",
                        dispatch.version,
                    )
                )
            self._drop(dispatch)
        return failed
