"""A group's rows sent as the wire states of its runs, encoded while the rest of the group ran.

A worker pads runs of a group's finished samples ahead of the group's end
(:mod:`agentloop.rollout.group_padding`). Encoding them for the wire
(:meth:`DataProto.wire_state <agentloop.batch.protocol.DataProto.wire_state>`: narrowed integers,
derived columns left out, padding runs trimmed) can happen then too, so that when the group's
last sample finishes only the rest is encoded and the states are joined here, column by column
(no tensor is rebuilt). The joined state loads as the DataProto that joining the padded runs and
pickling them would give, bit for bit (``tests/unit/test_wire_runs.py``); when the runs' states
do not agree in form (a column narrowed differently and not widenable, a derived column left out
of only some runs, differing ``meta_info``), :func:`merge_states` returns None and the caller
joins the rows and encodes them in one piece, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from agentloop.batch.protocol import DataProto
from agentloop.batch.protocol_wire import is_trimmed

__all__ = ["EncodedRows", "decode_state", "merge_states", "state_pads"]

def _widen(entry: Any, dtype: np.dtype) -> Any:
    """A packed column (array or trim tuple) of a narrower integer dtype as ``dtype``."""
    if isinstance(entry, np.ndarray):
        return entry.astype(dtype)
    _, old, shape, left, right, lead, trail, kept = entry
    old = np.dtype(old)
    bits = f"u{dtype.itemsize}"

    def cell(value: Any) -> Any:
        return np.array(value).astype(f"u{old.itemsize}").view(old).astype(dtype).view(bits)[()]

    return ("trim", dtype.str, shape, cell(left), cell(right), lead, trail,
            kept.view(old).astype(dtype).view(bits))


def _untrimmed(arr: np.ndarray, like: tuple[Any, ...]) -> tuple[Any, ...]:
    """A 2-D packed column as a trim tuple that keeps every cell (no leading or trailing run),
    with ``like``'s pads and run-length dtype."""
    zeros = np.zeros(len(arr), dtype=like[5].dtype)
    bits = np.ascontiguousarray(arr).view(f"u{arr.dtype.itemsize}").reshape(-1)
    return ("trim", arr.dtype.str, arr.shape, like[3], like[4], zeros, zeros, bits)


def _dtype_of(entry: Any) -> np.dtype:
    return entry.dtype if isinstance(entry, np.ndarray) else np.dtype(entry[1])


def _merge_column(entries: list[Any]) -> Any:
    """One packed column from the runs' (all arrays, or all trim tuples with the same pads and
    row shape; integer columns narrowed differently are widened to the widest); None when they
    cannot be joined without decoding."""
    dtypes = {_dtype_of(e) for e in entries}
    if len(dtypes) > 1:
        if not all(d.kind == "i" for d in dtypes):
            return None
        wide = max(dtypes, key=lambda d: d.itemsize)
        entries = [e if _dtype_of(e) == wide else _widen(e, wide) for e in entries]
    first = entries[0]
    if all(isinstance(e, np.ndarray) for e in entries):
        if len({e.shape[1:] for e in entries}) != 1:
            return None
        return np.concatenate(entries)
    trims = [e for e in entries if is_trimmed(e)]
    if len(trims) < len(entries):  # some runs' padding was not worth trimming: kept whole
        if not all(is_trimmed(e) or (isinstance(e, np.ndarray) and e.ndim == 2) for e in entries):
            return None
        entries = [e if is_trimmed(e) else _untrimmed(e, trims[0]) for e in entries]
        first = entries[0]
    if len({(e[2][1:], e[3].tobytes(), e[4].tobytes(), e[5].dtype, e[6].dtype)
            for e in entries}) != 1:
        return None
    rows = sum(e[2][0] for e in entries)
    return ("trim", first[1], (rows, *first[2][1:]), first[3], first[4],
            np.concatenate([e[5] for e in entries]), np.concatenate([e[6] for e in entries]),
            np.concatenate([e[7] for e in entries]))


def _merge_derived(recipes: list[dict[str, Any]]) -> dict[str, Any] | None:
    first = recipes[0]
    same = ("dtypes", "order", "width")
    if any(any(r.get(k) != first.get(k) for k in same) or ("span" in r) != ("span" in first)
           for r in recipes):
        return None
    out = dict(first)
    if "span" in first:
        spans = [r["span"] for r in recipes]
        if len({(s[0].dtype, s[1].dtype) for s in spans}) != 1:
            return None
        out["span"] = (np.concatenate([s[0] for s in spans]), np.concatenate([s[1] for s in spans]))
    return out


def state_pads(state: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
    """Per trimmed column of a wire state, its padding values
    (:func:`~agentloop.batch.protocol_wire.trim`'s ``pads``): the next runs of the group are
    trimmed with them, so that their states join."""
    batch = state.get("batch")
    if not isinstance(batch, dict):
        return {}
    return {k: (e[1], e[3], e[4]) for k, (e, _) in batch["tensors"].items() if is_trimmed(e)}


def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The wire state of consecutive runs' rows, from each run's
    :meth:`~agentloop.batch.protocol.DataProto.wire_state`, or None when they differ in form.

    Args:
        states: the runs' states in row order, every ``meta_info`` equal (per-row metrics taken
            out before encoding).
    """
    if not states:
        return None
    first = states[0]
    batches = [s["batch"] for s in states]
    head = batches[0]
    if not all(isinstance(b, dict) for b in batches):
        return None
    keys = list(head["tensors"])
    if any(list(b["tensors"]) != keys or ("derived" in b) != ("derived" in head) for b in batches):
        return None
    tensors: dict[str, Any] = {}
    for key in keys:
        torch_dtypes = {b["tensors"][key][1] for b in batches}
        column = _merge_column([b["tensors"][key][0] for b in batches])
        if column is None or len(torch_dtypes) != 1:
            return None
        tensors[key] = (column, head["tensors"][key][1])
    batch: dict[str, Any] = {
        "batch_size": [sum(int(b["batch_size"][0]) for b in batches), *head["batch_size"][1:]],
        "tensors": tensors,
    }
    if "derived" in head:
        derived = _merge_derived([b["derived"] for b in batches])
        if derived is None:
            return None
        batch["derived"] = derived
    names = list(first["non_tensor_batch"])
    if any(list(s["non_tensor_batch"]) != names or s["meta_info"] != first["meta_info"]
           for s in states):
        return None
    columns = {k: [s["non_tensor_batch"][k] for s in states] for k in names}
    if any(len({c.shape[1:] for c in cols}) != 1 for cols in columns.values()):
        return None
    return {
        "batch": batch,
        "non_tensor_batch": {k: np.concatenate(cols) for k, cols in columns.items()},
        "meta_info": first["meta_info"],
    }


def decode_state(state: dict[str, Any]) -> DataProto:
    """The DataProto a wire state stands for (what unpickling it gives)."""
    rows = DataProto.__new__(DataProto)
    rows.__setstate__(state)
    return rows


class EncodedRows:
    """Rows already encoded for the wire: pickled, they load as a DataProto (:func:`decode_state`)
    without being encoded again. ``meta_info`` holds what stays with the sender (the per-row
    ``metrics`` that :class:`~agentloop.rollout.worker.WorkerStats` takes out)."""

    __slots__ = ("state", "meta_info", "rows")

    def __init__(self, state: dict[str, Any], meta_info: dict[str, Any], rows: int) -> None:
        self.state, self.meta_info, self.rows = state, meta_info, rows

    def __len__(self) -> int:
        return self.rows

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return decode_state, (self.state,)
