"""Padding a stream's groups while their samples finish (issue 33 item 1).

A worker's group (a row range of its batch) used to be padded only once all its samples were done,
so in a batch whose samples finish within a few milliseconds of each other every row was padded
after the last one. :class:`GroupPadder` pads each run of consecutive finished samples of at least
``min_run`` rows as soon as it is complete (in the event-loop turn after they finish), and when the
group is done pads only what is left and joins the runs
(:func:`agentloop.batch.postprocess.join_padded`); the result equals padding the group in one
call, and when the runs' layouts differ the group is padded again in one call.

:class:`StreamingPadder` (the worker's stream, :data:`SHIP_RUNS`) does not wait for runs to be
consecutive: as soon as at least ``min_run`` samples of a group have finished and are not padded
yet, it pads them (in row order) and hands them to the stream to send at once, as a piece of their
group (:data:`PIECE_RUN`, the rows' positions in :data:`ROW_POSITIONS`); when the group is done it
pads only the samples not sent yet (:data:`PIECE_REST`).  The driver joins the pieces and puts the
rows back in order (``WorkerStats.joined``).  When a piece's layout differs from the first one's,
the whole group is padded again in one call and replaces them (:data:`PIECE_WHOLE`).
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agentloop.batch.postprocess import _layout as padded_layout
from agentloop.batch.postprocess import join_padded
from agentloop.batch.protocol import DataProto

Pad = Callable[[int, int], DataProto]
"""``pad(a, b)``: the padded rows of samples ``a`` to ``b`` (exclusive), all done."""
PadRows = Callable[[Sequence[int]], DataProto]
"""``pad_rows(rows)``: the padded rows of these samples (ascending, all done), with each row's
sample in ``meta_info[ROW_POSITIONS]``."""
Ship = Callable[[int, DataProto], None]
"""``ship(group, rows)``: a piece of the group padded ahead, to send now."""

PIECE_WHOLE = "whole"
"""A stream item holding all of its group's rows (any pieces sent before it are dropped)."""
PIECE_RUN = "run"
"""A stream item holding some of its group's rows, padded ahead; more of the group follows."""
PIECE_REST = "rest"
"""A stream item holding the rest of its group's rows: the group is its pieces, rows in order."""
ROW_POSITIONS = "row_positions"
"""The ``meta_info`` key of a padded piece's per-row sample index in the worker's batch (moved into
``WorkerStats.positions`` before it is sent)."""

MIN_RUN = 64
"""Fewest consecutive finished samples padded ahead of their group's end: each run costs a padding
call's fixed part and a join (~0.1 ms each); at 32 the stack's CPU per row rose ~4% (256-row
groups), at 64 it did not measurably. Groups of at most this many rows keep the one-call path."""

SHIP_RUNS = True
"""Whether the worker's stream sends pieces ahead (:class:`StreamingPadder`, the default) or joins
consecutive runs in the worker (:class:`GroupPadder`, the design before;
``scripts/bench_after_last.py`` compares the two)."""


class GroupPadder:
    """Pads the groups of ``tasks`` (one per sample; group ``g`` is ``bounds[g]:bounds[g + 1]``)
    ahead of their end when ``early`` (see the module docstring), and records when each group's
    last sample finished.

    Args:
        tasks: the samples' tasks, in row order.
        bounds: the groups' first rows, then ``len(tasks)``.
        pad: pads a row range (:data:`Pad`); an error padding a run ahead is left for
            :meth:`take`'s one call to raise.
        early: pad runs ahead (off: only :meth:`take` pads, as before).
        min_run: the fewest samples of a run padded ahead (default :data:`MIN_RUN`).
    """

    def __init__(
        self, tasks: Sequence[asyncio.Task], bounds: Sequence[int], pad: Pad, early: bool = True,
        min_run: int | None = None,
    ) -> None:
        min_run = MIN_RUN if min_run is None else min_run
        self.tasks, self.bounds, self.pad, self.min_run = tasks, list(bounds), pad, min_run
        groups = len(bounds) - 1
        self.padded = self.bounds[:-1]  # per group: its first row not padded yet
        self.scanned = self.bounds[:-1]  # per group: its first row not known to be done
        self.parts: list[list[DataProto]] = [[] for _ in range(groups)]
        self.done_at = [0.0] * groups
        self.early = [early and bounds[g + 1] - bounds[g] > min_run for g in range(groups)]
        self.dirty: set[int] = set()
        self.loop = asyncio.get_running_loop()
        for i, task in enumerate(tasks):
            task.add_done_callback(functools.partial(self._finished, i))

    def _group(self, row: int) -> int:
        return bisect.bisect_right(self.bounds, row) - 1

    def _finished(self, row: int, _: asyncio.Task) -> None:
        """Done-callback of a sample's task: the time, and a look at its group next turn."""
        g = self._group(row)
        self.done_at[g] = time.time()
        if self.early[g]:
            if not self.dirty:
                self.loop.call_soon(self._advance)
            self.dirty.add(g)

    def _advance(self) -> None:
        """Pad the runs of finished samples long enough, in the groups that changed."""
        dirty, self.dirty = self.dirty, set()
        for g in sorted(dirty):
            end, b = self.bounds[g + 1], self.scanned[g]
            while b < end and self.tasks[b].done():
                b += 1
            self.scanned[g] = b
            a = self.padded[g]
            if b == end or b - a < self.min_run or not self.early[g]:
                continue  # a done group's rest is padded by take()
            try:
                part = self.pad(a, b)
            except Exception:  # noqa: BLE001 - take() pads the group in one call and raises it
                self.early[g], self.parts[g] = False, []
                continue
            self.parts[g].append(part)
            self.padded[g] = b

    def take(self, g: int) -> tuple[DataProto, float]:
        """Group ``g``'s padded rows (all its samples done) and when its last sample finished
        (``time.time()``; now for an empty group)."""
        start, end = self.bounds[g], self.bounds[g + 1]
        done_at = self.done_at[g] or time.time()
        parts, self.parts[g] = self.parts[g], []
        if not parts:
            return self.pad(start, end), done_at
        a = self.padded[g]
        try:
            joined = join_padded(parts + [self.pad(a, end)] if a < end else parts)
        except Exception:  # noqa: BLE001 - the one call below raises it, rows numbered as before
            joined = None
        return (self.pad(start, end) if joined is None else joined), done_at


class StreamingPadder:
    """Pads the samples of each group of ``tasks`` that finished, at least ``min_run`` at a time and
    in any order, and ships them as pieces while the rest of the group runs (see the module
    docstring); records when each group's last sample finished.

    Args:
        tasks: the samples' tasks, in row order.
        bounds: the groups' first rows, then ``len(tasks)``.
        pad_rows: pads samples by index (:data:`PadRows`); an error padding a piece ahead is left
            for :meth:`finish`'s one call to raise.
        ship: sends a piece now (:data:`Ship`).
        min_run: the fewest samples of a piece sent ahead (default :data:`MIN_RUN`); groups of at
            most this many rows are padded once, whole.
    """

    def __init__(
        self, tasks: Sequence[asyncio.Task], bounds: Sequence[int], pad_rows: PadRows, ship: Ship,
        min_run: int | None = None,
    ) -> None:
        self.min_run = MIN_RUN if min_run is None else min_run
        self.bounds, self.pad_rows, self.ship = list(bounds), pad_rows, ship
        groups = len(bounds) - 1
        self.left = [bounds[g + 1] - bounds[g] for g in range(groups)]  # samples still running
        self.waiting: list[list[int]] = [[] for _ in range(groups)]  # finished, not padded
        self.early = [n > self.min_run for n in self.left]
        self.layout: list[tuple[object, ...] | None] = [None] * groups  # the pieces sent
        self.done_at = [0.0] * groups
        self.dirty: set[int] = set()
        self.loop = asyncio.get_running_loop()
        for i, task in enumerate(tasks):
            task.add_done_callback(functools.partial(self._finished, i))

    def _finished(self, row: int, _: asyncio.Task) -> None:
        """Done-callback of a sample's task: the time, and a piece next turn when enough wait."""
        g = bisect.bisect_right(self.bounds, row) - 1
        self.done_at[g] = time.time()
        self.left[g] -= 1
        if self.early[g]:
            self.waiting[g].append(row)
            if self.left[g] and len(self.waiting[g]) >= self.min_run:
                if not self.dirty:
                    self.loop.call_soon(self._advance)
                self.dirty.add(g)

    def _advance(self) -> None:
        """Pad and ship the waiting samples of the groups that have enough and are still running
        (a done group's rest is :meth:`finish`'s)."""
        dirty, self.dirty = self.dirty, set()
        for g in sorted(dirty):
            if not self.left[g] or not self.early[g] or len(self.waiting[g]) < self.min_run:
                continue
            rows, self.waiting[g] = sorted(self.waiting[g]), []
            try:
                part = self.pad_rows(rows)
            except Exception:  # noqa: BLE001 - finish() pads the group in one call and raises it
                self.early[g] = False
                continue
            layout = padded_layout(part)
            if self.layout[g] is None:
                self.layout[g] = layout
            elif layout != self.layout[g]:  # cannot join the pieces sent: finish() sends it whole
                self.early[g] = False
                continue
            self.ship(g, part)

    def finish(self, g: int) -> tuple[DataProto, float, str]:
        """Group ``g``'s rows not sent yet (all its samples done), when its last sample finished
        (``time.time()``; now for an empty group) and the piece kind: :data:`PIECE_REST` (to join
        with the pieces sent), else :data:`PIECE_WHOLE` (none was sent, or the rest's layout
        differs from theirs: the whole group padded in one call)."""
        start, end = self.bounds[g], self.bounds[g + 1]
        done_at = self.done_at[g] or time.time()
        rest, self.waiting[g] = sorted(self.waiting[g]), []
        if self.layout[g] is not None and self.early[g] and rest:
            try:
                part = self.pad_rows(rest)
            except Exception:  # noqa: BLE001 - the one call below raises it, rows numbered as before
                part = None
            if part is not None and padded_layout(part) == self.layout[g]:
                return part, done_at, PIECE_REST
        return self.pad_rows(range(start, end)), done_at, PIECE_WHOLE


def join_group_pieces(pieces: Sequence[DataProto]) -> DataProto:
    """A group's pieces (without their per-row metrics and positions) as one DataProto, rows in
    the order the pieces came; ``WorkerStats.joined`` puts them in row order."""
    return pieces[0] if len(pieces) == 1 else DataProto.concat(list(pieces))


@dataclass
class WorkerStats:
    """What a worker reports with a group's rows, besides the rows."""

    server_failovers: int = 0
    """Requests its router moved to another server (a server died) since the previous group."""
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """Per row, in row order: the loop's timing metrics (verl's ``meta_info["metrics"]``)."""
    done_at: float = 0.0
    """When the group's last sample finished (``time.time()``, its task's end; runs of its rows
    may be padded before that, :mod:`agentloop.rollout.group_padding`); 0.0 for rows no worker
    rolled out, and for a run sent ahead."""
    piece: str = PIECE_WHOLE
    """What part of its group a stream item holds: all of it (``whole``), some of its rows sent
    ahead while the rest runs (``run``), or the rest (``rest``)
    (:mod:`agentloop.rollout.group_padding`); :meth:`joined` makes the group of them."""
    positions: list[int] | None = None
    """Per row, its sample's index in the worker's batch (a piece's rows need not be consecutive);
    None for rows no worker rolled out."""

    @classmethod
    def take(
        cls, rows: DataProto, server_failovers: int = 0, done_at: float = 0.0,
        piece: str = PIECE_WHOLE,
    ) -> WorkerStats:
        """The stats of freshly padded ``rows``: their per-row metrics (a list per part, which
        ``DataProto.concat`` would fold into a dict) and sample positions move out of
        ``meta_info`` into the stats."""
        metrics = rows.meta_info.pop("metrics", None) or []
        positions = rows.meta_info.pop(ROW_POSITIONS, None)
        return cls(server_failovers, metrics, done_at, piece, positions)

    @staticmethod
    def joined(pieces: list[tuple[DataProto, WorkerStats]]) -> tuple[DataProto, WorkerStats]:
        """A group's stream items (its pieces in the order they came, the rest last) as its rows
        and stats, rows in sample order (one ``whole`` item is returned as it is)."""
        if len(pieces) == 1:
            return pieces[0]
        rows = join_group_pieces([r for r, _ in pieces])
        metrics = [m for _, s in pieces for m in s.metrics]
        positions = [p for _, s in pieces for p in s.positions or ()]
        if len(positions) == len(rows):
            order = np.argsort(np.asarray(positions), kind="stable")
            if (order != np.arange(len(order))).any():
                rows.reorder(order)
                metrics = [metrics[i] for i in order.tolist()]
                positions = [positions[i] for i in order.tolist()]
        stats = WorkerStats(
            sum(s.server_failovers for _, s in pieces), metrics, pieces[-1][1].done_at,
            positions=positions,
        )
        return rows, stats
