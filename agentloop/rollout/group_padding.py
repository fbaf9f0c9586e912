"""Padding a stream's groups while their samples finish (issue 33 item 1).

A worker's group (a row range of its batch) used to be padded only once all its samples were done,
so in a batch whose samples finish within a few milliseconds of each other every row was padded
after the last one. :class:`GroupPadder` pads each run of consecutive finished samples of at least
``min_run`` rows as soon as it is complete (in the event-loop turn after they finish), and when the
group is done pads only what is left and joins the runs
(:func:`agentloop.batch.postprocess.join_padded`); the result equals padding the group in one
call, and when the runs' layouts differ the group is padded again in one call.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import time
from collections.abc import Callable, Sequence

from agentloop.batch.postprocess import join_padded
from agentloop.batch.protocol import DataProto

Pad = Callable[[int, int], DataProto]
"""``pad(a, b)``: the padded rows of samples ``a`` to ``b`` (exclusive), all done."""

MIN_RUN = 64
"""Fewest consecutive finished samples padded ahead of their group's end: each run costs a padding
call's fixed part and a join (~0.1 ms each); at 32 the stack's CPU per row rose ~4% (256-row
groups), at 64 it did not measurably. Groups of at most this many rows keep the one-call path."""


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
