"""Columns of verl's rollout layout left out of a pickled DataProto when they follow from others.

In the padded rollout layout (docs/concepts.md#the-output-layout) ``input_ids`` is
``concat(prompts, responses)`` and the 2-D ``attention_mask`` / ``position_ids`` follow from each
row's real-token span ``[start, start + total)``: the mask is 1 inside it, the position is
``column - start`` clipped to ``[0, max(total - 1, 0)]``. Together they are ~70% of a rollout
batch's cells. :func:`split_derived` proves each of them equal to its rebuild (every cell, integer
dtypes only) before leaving it out, so anything else (a 3-D multimodal ``position_ids``, a row that
does not match, a float or bool column) travels as it is; :func:`join_derived` rebuilds them on load
with their own dtype, bit-identical, in the batch's key order. Used by ``DataProto.__getstate__`` /
``__setstate__``.

:func:`trim` / :func:`untrim` carry a padded 2-D column as its rows' cells between a leading run of
one value and a trailing run of another (left-padded ``prompts``, right-padded ``responses``,
masks and log-probs), compared and rebuilt bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "DERIVED", "SHRINK_ABOVE", "is_trimmed", "join_derived", "split_derived", "trim", "untrim",
]

DERIVED = ("input_ids", "attention_mask", "position_ids")
"""The columns that may be left out, in the order they are tried."""

SHRINK_ABOVE = 64 * 1024
"""``DataProto.__getstate__`` leaves columns out and trims padding runs only when the batch's packed
tensors hold at least this many bytes: Ray inlines objects under 100 KB, and below this size the
checks' fixed cost (~0.15 ms a pickle, ~0.07 ms a load, whatever the rows) outweighs the bytes."""

elide: bool = True
"""Module switch: False sends every column as is (``scripts/bench_after_last.py`` alternates it)."""
trim_runs: bool = True
"""Module switch for :func:`trim` alone (with :data:`elide` True)."""


def _integer_2d(arr: Any) -> bool:
    """Whether ``arr`` is a 2-D numpy array of a signed or unsigned integer dtype."""
    return isinstance(arr, np.ndarray) and arr.ndim == 2 and arr.dtype.kind in "iu"


def _span_of(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(start, total)`` per row: the first nonzero column (0 for an empty row) and the count of
    nonzero cells. Only a guess: the caller rebuilds the mask from it and compares."""
    nonzero = mask != 0
    return nonzero.argmax(axis=1), nonzero.sum(axis=1)


def _relative(start: np.ndarray, width: int) -> np.ndarray:
    """``column - start`` per row, int32, shape ``(rows, width)``."""
    return np.arange(width, dtype=np.int32)[None, :] - start.astype(np.int32)[:, None]


def _mask(rel: np.ndarray, total: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The attention mask of spans ``rel`` / ``total`` in ``dtype``."""
    inside = (rel >= 0) & (rel < total.astype(np.int32)[:, None])
    return inside.astype(dtype)


def _positions(rel: np.ndarray, total: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The position ids of spans ``rel`` / ``total`` in ``dtype``."""
    top = np.maximum(total.astype(np.int32) - 1, 0)[:, None]
    return np.clip(rel, 0, top).astype(dtype)


def _narrow(values: np.ndarray, width: int) -> np.ndarray:
    """A span column as int16 when the row width allows it, else int32."""
    return values.astype(np.int16 if width < 2**15 else np.int32)


def _input_ids_derived(cols: dict[str, np.ndarray]) -> bool:
    """Whether ``input_ids`` equals ``concat(prompts, responses)`` cell for cell."""
    ids, prompts, responses = (cols.get(k) for k in ("input_ids", "prompts", "responses"))
    if not (_integer_2d(ids) and _integer_2d(prompts) and _integer_2d(responses)):
        return False
    assert ids is not None and prompts is not None and responses is not None
    p = prompts.shape[1]
    return (
        ids.shape == (prompts.shape[0], p + responses.shape[1])
        and np.array_equal(ids[:, :p], prompts)
        and np.array_equal(ids[:, p:], responses)
    )


def split_derived(cols: dict[str, np.ndarray]) -> tuple[list[str], dict[str, Any]]:
    """Which of :data:`DERIVED` can be left out of ``cols`` (numpy arrays, one per tensor column).

    Args:
        cols: the batch's columns as numpy arrays, in its key order.
    Returns:
        ``(left_out, recipe)``: the names proven equal to their rebuild, and what
        :func:`join_derived` needs (each one's dtype, the row spans when the mask is left out, the
        key order); ``([], {})`` when nothing can be left out or :data:`elide` is False.
    """
    if not elide:
        return [], {}
    out: list[str] = []
    recipe: dict[str, Any] = {"dtypes": {}}
    if _input_ids_derived(cols):
        out.append("input_ids")
    mask, pos = cols.get("attention_mask"), cols.get("position_ids")
    if _integer_2d(mask) and mask is not None and mask.shape[1] > 0:
        start, total = _span_of(mask)
        rel = _relative(start, mask.shape[1])
        if np.array_equal(_mask(rel, total, mask.dtype), mask):
            out.append("attention_mask")
            recipe["span"] = (_narrow(start, mask.shape[1]), _narrow(total, mask.shape[1] + 1))
            recipe["width"] = mask.shape[1]
            if (
                _integer_2d(pos) and pos is not None and pos.shape == mask.shape
                and np.array_equal(_positions(rel, total, pos.dtype), pos)
            ):
                out.append("position_ids")
    if not out:
        return [], {}
    recipe["dtypes"] = {k: cols[k].dtype.str for k in out}
    recipe["order"] = list(cols)
    return out, recipe


def join_derived(cols: dict[str, np.ndarray], recipe: dict[str, Any]) -> dict[str, np.ndarray]:
    """Inverse of :func:`split_derived`: ``cols`` (the columns that travelled) with the left-out
    ones rebuilt, in the original key order.

    Args:
        cols: the columns that travelled, restored to their own dtypes.
        recipe: the second value :func:`split_derived` returned.
    Returns:
        Every column, fresh writable arrays for the rebuilt ones.
    """
    dtypes = {k: np.dtype(v) for k, v in recipe["dtypes"].items()}
    built: dict[str, np.ndarray] = {}
    if "input_ids" in dtypes:
        built["input_ids"] = np.concatenate(
            [cols["prompts"], cols["responses"]], axis=1
        ).astype(dtypes["input_ids"])
    if "attention_mask" in dtypes:
        start, total = recipe["span"]
        rel = _relative(np.asarray(start), int(recipe["width"]))
        built["attention_mask"] = _mask(rel, np.asarray(total), dtypes["attention_mask"])
        if "position_ids" in dtypes:
            built["position_ids"] = _positions(rel, np.asarray(total), dtypes["position_ids"])
    return {k: cols[k] if k in cols else built[k] for k in recipe["order"]}



TRIM_KEEP = 0.75
""":func:`trim` applies when at most this share of the cells remains."""


def _runs(bits: np.ndarray, value: np.ndarray) -> np.ndarray:
    """Per row, the length of the leading run of ``value`` in ``bits`` (the row's width when the
    whole row is that value)."""
    other = bits != value
    return np.where(other.any(axis=1), other.argmax(axis=1), bits.shape[1])


def _majority(column: np.ndarray) -> np.ndarray:
    """The value of a 1-D array's middle element in sorted order: the most frequent value whenever
    one value fills more than half of it (a padded column's pad). Any value keeps :func:`trim`
    exact; only its saving depends on the choice."""
    middle = len(column) // 2
    return np.partition(column, middle)[middle]


def _keep_mask(lead: np.ndarray, trail: np.ndarray, width: int) -> np.ndarray:
    """Cells of each row between its leading and trailing runs."""
    col = np.arange(width, dtype=np.int32)[None, :]
    return (col >= lead.astype(np.int32)[:, None]) & (col < width - trail.astype(np.int32)[:, None])


def _pads_as(pads: tuple[Any, ...], dtype: np.dtype) -> tuple[Any, Any] | None:
    """``pads`` (``(dtype string, leading bits, trailing bits)``) as raw bits of ``dtype``: the
    same values when the dtypes are integers and both fit; None when they do not."""
    source = np.dtype(pads[0])
    unsigned = np.dtype(f"u{dtype.itemsize}")
    if source == dtype:
        return np.array(pads[1], unsigned)[()], np.array(pads[2], unsigned)[()]
    if source.kind not in "iu" or dtype.kind not in "iu":
        return None
    values = [int(np.array(v, f"u{source.itemsize}").view(source)) for v in pads[1:]]
    info = np.iinfo(dtype)
    if not all(info.min <= v <= info.max for v in values):
        return None
    left, right = (np.array(v, dtype).view(unsigned)[()] for v in values)
    return left, right


def trim(arr: np.ndarray, pads: tuple[Any, Any] | None = None) -> np.ndarray | tuple[Any, ...]:
    """``arr`` without each row's leading run of one value and trailing run of another, when that
    leaves at most :data:`TRIM_KEEP` of its cells; else ``arr`` itself.

    Args:
        arr: any numpy array; only 2-D ones with cells are trimmed (values compared as raw bits,
            so floats' signed zeros and NaNs come back exactly).
        pads: ``(dtype string, leading bits, trailing bits)`` of another run's :func:`trim` (its
            tuple's second, fourth and fifth items), so that the two join
            (:mod:`agentloop.batch.wire_runs`); then ``arr`` is trimmed whatever it saves (when
            the values fit its dtype; else as without ``pads``).
    Returns:
        ``arr`` or the tuple :func:`untrim` takes.
    """
    if (
        not (elide and trim_runs) or arr.ndim != 2 or arr.size == 0
        or arr.dtype.itemsize not in (1, 2, 4, 8) or arr.dtype.hasobject
    ):
        return arr
    bits = np.ascontiguousarray(arr).view(f"u{arr.dtype.itemsize}")
    fixed = None if pads is None else _pads_as(pads, arr.dtype)
    if fixed is None:
        pads = None
        left, right = _majority(bits[:, 0]), _majority(bits[:, -1])
    else:
        left, right = fixed
    lead = _runs(bits, left)
    trail = np.minimum(_runs(bits[:, ::-1], right), bits.shape[1] - lead)
    if pads is None and bits.size - int(lead.sum()) - int(trail.sum()) > TRIM_KEEP * bits.size:
        return arr
    width = bits.shape[1]
    narrow = np.int16 if width < 2**15 else np.int32
    kept = bits[_keep_mask(lead, trail, width)]
    return ("trim", arr.dtype.str, arr.shape, left, right, lead.astype(narrow),
            trail.astype(narrow), kept)


def is_trimmed(packed: Any) -> bool:
    """Whether ``packed`` is :func:`trim`'s tuple (not an array kept whole)."""
    return isinstance(packed, tuple) and len(packed) == 8 and packed[0] == "trim"


def untrim(packed: np.ndarray | tuple[Any, ...]) -> np.ndarray:
    """Inverse of :func:`trim` (an array passes through).

    Raises:
        ValueError: ``packed`` is neither an array nor :func:`trim`'s tuple.
    """
    if isinstance(packed, np.ndarray):
        return packed
    if not is_trimmed(packed):
        raise ValueError(f"untrim: not an array nor a trimmed column: {type(packed).__name__}")
    _, dtype, shape, left, right, lead, trail, kept = packed
    col = np.arange(shape[1], dtype=np.int32)[None, :]
    before = col < lead.astype(np.int32)[:, None]
    bits = np.where(before, left, right).astype(kept.dtype, copy=False)
    bits[~before & (col < shape[1] - trail.astype(np.int32)[:, None])] = kept
    return bits.view(np.dtype(dtype))
