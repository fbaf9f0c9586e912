"""The parts the dispatcher hands around: :class:`Group` (rows out), :class:`Finished` (rows back),
:class:`Dispatch` (one streaming call), and :func:`split_groups`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agentloop.batch.protocol import DataProto
from agentloop.rollout.worker import WorkerStats
from agentloop.rollout.worker_slots import WorkerSlot

__all__ = ["Dispatch", "Finished", "Group", "split_groups"]


def split_groups(batch: DataProto, group_by: str | None) -> list[DataProto]:
    """``batch`` split into its groups (rows sharing ``non_tensor_batch[group_by]``; each row alone
    when ``group_by`` is None or not a column), groups in the order of their first row.
    ``global_steps`` is left out of each part's meta_info: groups of different batches may be
    dispatched together, the dispatch sets it."""
    keys = batch.non_tensor_batch.get(group_by) if group_by else None
    if keys is None:
        parts = [batch.slice(i, i + 1) for i in range(len(batch))]
    else:
        rows: dict[Any, list[int]] = {}
        for i, k in enumerate(keys.tolist()):
            rows.setdefault(k, []).append(i)
        parts = [batch.select_idxs(np.asarray(idx)) for idx in rows.values()]
    for part in parts:
        part.meta_info = {k: v for k, v in part.meta_info.items() if k != "global_steps"}
    return parts


@dataclass(eq=False)
class Group:
    """Prompt rows handed out and returned together (a GRPO prompt's ``n`` samples, or a range of
    a batch)."""

    rows: DataProto
    key: Any = None
    """The caller's name for it (a group number, a row range's index)."""
    retries: int = 0
    """Times it was rolled out again because its worker died (reset when it finishes)."""


@dataclass
class Finished:
    """A group's padded rows: rolled out, or made by the dispatcher when no worker could roll it
    out."""

    group: Group
    rows: DataProto
    stats: WorkerStats
    version: int
    """The weight version when its dispatch started."""
    fault: str = ""
    """Why the dispatcher gave up on it (its rows are ``error`` / ``timeout`` rows); empty when
    rolled out."""


@dataclass(eq=False)
class Dispatch:
    """One streaming call: groups sent to one worker together."""

    groups: list[Group]
    slot: WorkerSlot
    handle: Any
    """The worker actor it was sent to (the slot may run a replacement later)."""
    ref: Any
    """The Ray streaming generator."""
    version: int
    finished: set[int] = field(default_factory=set)
    token: int | None = None
    """Its frames' token on the result channel (None: its rows come through the stream)."""
    worker_id: str = ""
    """The id of the worker actor it was sent to."""
    ended_at: float | None = None
    """When its stream ended with groups still missing (their frames on the way)."""

    def unfinished(self) -> list[Group]:
        """Its groups not yet returned."""
        return [g for i, g in enumerate(self.groups) if i not in self.finished]
