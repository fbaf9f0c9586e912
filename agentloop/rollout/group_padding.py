"""Padding a stream's groups while their samples finish (issue 33 item 1).

A worker's group (a row range of its batch) used to be padded only once all its samples were done,
so in a batch whose samples finish within a few milliseconds of each other every row was padded
after the last one. :class:`GroupPadder` pads each run of consecutive finished samples of at least
``min_run`` rows as soon as it is complete (in the event-loop turn after they finish), and when the
group is done pads only what is left and joins the runs
(:func:`agentloop.batch.postprocess.join_padded`); the result equals padding the group in one
call, and when the runs' layouts differ the group is padded again in one call.

With ``encode`` (a worker's stream to the driver) each run padded ahead is also encoded for the wire
then (:mod:`agentloop.batch.wire_runs`), so when the group is done only its rest is padded and
encoded, and :meth:`GroupPadder.take` returns the runs' states joined
(:class:`~agentloop.batch.wire_runs.EncodedRows`, which loads as the DataProto it stands for).
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import time
from collections.abc import Callable, Sequence

from agentloop.batch.postprocess import join_padded
from agentloop.batch.protocol import DataProto
from agentloop.batch.wire_runs import EncodedRows, merge_states, state_pads

Pad = Callable[[int, int], DataProto]
"""``pad(a, b)``: the padded rows of samples ``a`` to ``b`` (exclusive), all done."""

MIN_RUN = 64
"""Fewest consecutive finished samples padded ahead of their group's end: each run costs a padding
call's fixed part and a join (~0.1 ms each); at 32 the stack's CPU per row rose ~4% (256-row
groups), at 64 it did not measurably. Groups of at most this many rows keep the one-call path."""

ENCODE_AHEAD = True
"""Module switch: False leaves the runs padded ahead unencoded (``scripts/bench_after_last.py``
alternates it)."""


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
        encode: encode the runs padded ahead for the wire too (see the module docstring; off
            when :data:`ENCODE_AHEAD` is False).
        on_done: called with a group's number as soon as all its samples are done (an empty group:
            in the event loop's next turn), in that order.
    """

    def __init__(
        self, tasks: Sequence[asyncio.Task], bounds: Sequence[int], pad: Pad, early: bool = True,
        min_run: int | None = None, encode: bool = False,
        on_done: Callable[[int], object] | None = None,
    ) -> None:
        min_run = MIN_RUN if min_run is None else min_run
        self.encode = encode and ENCODE_AHEAD
        self.tasks, self.bounds, self.pad, self.min_run = tasks, list(bounds), pad, min_run
        groups = len(bounds) - 1
        self.padded = self.bounds[:-1]  # per group: its first row not padded yet
        self.scanned = self.bounds[:-1]  # per group: its first row not known to be done
        self.parts: list[list[DataProto]] = [[] for _ in range(groups)]
        # per group: the wire state of each part (None: not encoded), per-row metrics taken out
        self.states: list[list[dict | None]] = [[] for _ in range(groups)]
        self.pads: list[dict[str, tuple]] = [{} for _ in range(groups)]  # trim pads, per group
        self.done_at = [0.0] * groups
        self.early = [early and bounds[g + 1] - bounds[g] > min_run for g in range(groups)]
        self.dirty: set[int] = set()
        self.loop = asyncio.get_running_loop()
        self.on_done = on_done
        self.left = [bounds[g + 1] - bounds[g] for g in range(groups)]  # samples still running
        for g in range(groups):
            if not self.left[g] and on_done is not None:
                self.loop.call_soon(on_done, g)
        for i, task in enumerate(tasks):
            task.add_done_callback(functools.partial(self._finished, i))

    def _group(self, row: int) -> int:
        return bisect.bisect_right(self.bounds, row) - 1

    def _finished(self, row: int, _: asyncio.Task) -> None:
        """Done-callback of a sample's task: the time, a look at its group next turn, and
        ``on_done`` when it was the group's last."""
        g = self._group(row)
        self.done_at[g] = time.time()
        self.left[g] -= 1
        if self.early[g]:
            if not self.dirty:
                self.loop.call_soon(self._advance)
            self.dirty.add(g)
        if not self.left[g] and self.on_done is not None:
            self.on_done(g)

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
                self.early[g], self.parts[g], self.states[g] = False, [], []
                continue
            self.parts[g].append(part)
            self.states[g].append(self._wire(g, part) if self.encode else None)
            self.padded[g] = b

    def take(self, g: int) -> tuple[DataProto | EncodedRows, float]:
        """Group ``g``'s padded rows (all its samples done; :class:`EncodedRows` when its runs
        were encoded ahead and their states join) and when its last sample finished
        (``time.time()``; now for an empty group)."""
        start, end = self.bounds[g], self.bounds[g + 1]
        done_at = self.done_at[g] or time.time()
        parts, self.parts[g] = self.parts[g], []
        states, self.states[g] = self.states[g], []
        if not parts:
            return self.pad(start, end), done_at
        a = self.padded[g]
        try:
            if a < end:
                parts.append(self.pad(a, end))
                states.append(self._wire(g, parts[-1]) if self.encode else None)
            encoded = _encoded(parts, states) if self.encode else None
            if encoded is not None:
                return encoded, done_at
            joined = join_padded(parts)
        except Exception:  # noqa: BLE001 - the one call below raises it, rows numbered as before
            joined = None
        return (self.pad(start, end) if joined is None else joined), done_at

    def _wire(self, g: int, part: DataProto) -> dict | None:
        """A padded run of group ``g`` encoded for the wire, trimmed with the padding values its
        group's runs before chose, without its per-row metrics (they stay with the worker); None
        when it cannot be encoded on its own."""
        bare = DataProto(part.batch, part.non_tensor_batch,
                         {k: v for k, v in part.meta_info.items() if k != "metrics"})
        try:
            state = bare.wire_state(shrink=True, pads=self.pads[g])
        except Exception:  # noqa: BLE001 - encoded in one piece at the end instead
            return None
        self.pads[g] = {**state_pads(state), **self.pads[g]}
        return state


def _encoded(parts: list[DataProto], states: list[dict | None]) -> EncodedRows | None:
    """The parts' states joined, or None when one is missing or they differ in form."""
    if any(s is None for s in states):
        return None
    merged = merge_states([s for s in states if s is not None])
    if merged is None:
        return None
    metrics = [m for p in parts for m in p.meta_info.get("metrics", [])]
    return EncodedRows(merged, {"metrics": metrics}, sum(len(p) for p in parts))
