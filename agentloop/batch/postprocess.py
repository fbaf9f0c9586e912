"""Pad a flat list of :class:`~agentloop.types.AgentLoopOutput` into verl's rollout DataProto
layout.

:func:`postprocess` returns one row per trajectory: the tensor columns (``prompts``, ``responses``,
``input_ids``, ``attention_mask``, ``position_ids``, ``response_mask``, optional
``rollout_log_probs`` / ``rollout_weight_versions``, and the reward columns when the batch has a
reward source) and the non-tensor columns (``__num_turns__``, ``status``, ``error``, episode
columns, ``extra_fields`` keys, ``sample_fields``); it raises
:class:`~agentloop.errors.DatasetError` for inconsistent rows. Spec (every column, dtypes, padding,
precedence when names collide): docs/concepts.md#the-output-layout.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from itertools import chain
from operator import itemgetter, methodcaller
from typing import Any, cast

import numpy as np
import torch
from tensordict import TensorDict

from agentloop.batch.protocol import DataProto, object_array
from agentloop.batch.routed_experts import ROUTED_EXPERTS_KEY, pad_routed_experts
from agentloop.errors import DatasetError
from agentloop.rewards.columns import reward_columns, reward_extra_columns
from agentloop.types import AgentLoopMetrics, AgentLoopOutput, RolloutStatus
from agentloop.utils.ids import fresh_hex

_BUILTIN_COLUMNS = (
    "__num_turns__", "status", "error", "multi_modal_data", "trajectory_index", "num_trajectories",
    "session_id",
)
EPISODE_COLUMNS = ("trajectory_index", "num_trajectories", "session_id")
"""Per-row episode columns: which trajectory of its sample a row is, of how many, and the
episode's id."""


def _lengths(rows: Sequence[Sequence[Any]]) -> np.ndarray:
    """Lengths of ragged rows as an int64 array."""
    return np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))


# ``array`` type codes with the same item layout as these numpy dtypes (a list converts fastest
# through them).
_ARRAY_CODES = {np.dtype(code): code for code in ("q", "l", "i", "h", "b", "d", "f")
                if np.dtype(code).itemsize == array.array(code).itemsize}


_SEQUENCES = frozenset((list, tuple))
_COUNT_ONES = methodcaller("count", 1)


def _row_array(row: Sequence[Any], dtype: np.dtype) -> Any:
    """``row`` as something numpy copies from without per-item work: a numpy array as is, a list
    through an ``array.array`` of the same layout (falling back to ``np.asarray`` for items that
    type rejects).
    """
    if isinstance(row, np.ndarray):
        return row
    code = _ARRAY_CODES.get(dtype)
    if code is not None:
        try:
            return np.frombuffer(array.array(code, row), dtype=dtype)
        except (TypeError, OverflowError):
            pass
    return np.asarray(row, dtype=dtype)


def _fill_flat(out: np.ndarray, rows: Sequence[Sequence[Any]], left: bool) -> list[int] | None:
    """:func:`fill_rows` in one copy: the kept items of every row joined into one ``array.array``
    and scattered through a mask of the row-data cells (row-major, so each row's items land in
    order).  None (nothing written) when a row is not a list or tuple or an item does not fit
    ``out``'s ``array`` type: the per-row path handles those."""
    code = _ARRAY_CODES.get(out.dtype)
    if code is None or not set(map(type, rows)) <= _SEQUENCES:
        return None
    width = out.shape[1]
    lengths = _lengths(rows)
    kept = np.minimum(lengths, width)
    flat: list[Any] = []
    if (lengths > width).any():
        for row, n in zip(rows, lengths.tolist(), strict=True):
            if n <= width:
                flat += row
            elif left:
                flat += row[n - width:]
            else:
                flat += row[:width]
    else:
        for row in rows:
            flat += row
    try:
        values = np.frombuffer(array.array(code, flat), dtype=out.dtype)
    except (TypeError, OverflowError):
        return None
    if out.flags.c_contiguous and values.size == out.size:  # every row fills its width
        out.reshape(-1)[:] = values
        return kept.tolist()
    cols = np.arange(width)
    if left:
        out[cols[None, :] >= (width - kept)[:, None]] = values
    else:
        out[cols[None, :] < kept[:, None]] = values
    return kept.tolist()


def fill_rows(out: np.ndarray, rows: Sequence[Sequence[Any]], *, left: bool = False) -> list[int]:
    """Copy ragged ``rows`` into ``out`` [len(rows), width], already holding the padding value, in
    place.

    With ``left`` rows are left-padded (a longer row keeps its last ``width`` items), else
    right-padded (a longer row keeps its first ``width``).  Each row is converted once; padding
    cells are not touched. Returns each row's kept length."""
    width = out.shape[1]
    flat = _fill_flat(out, rows, left)
    if flat is not None:
        return flat
    kept: list[int] = []
    for b, row in enumerate(rows):
        n = len(row)
        keep = n if n <= width else width
        kept.append(keep)
        if keep == 0:
            continue
        if n > keep:
            row = row[n - keep:] if left else row[:keep]
        if left:
            out[b, width - keep:] = _row_array(row, out.dtype)
        else:
            out[b, :keep] = _row_array(row, out.dtype)
    return kept


def _or_empty(row: Sequence[Any] | None) -> Sequence[Any]:
    return () if row is None else row


def pad_rows(
    rows: Sequence[Sequence[Any]], width: int, fill: float, dtype: Any, *, left: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Pack ragged ``rows`` into a ``[len(rows), width]`` array.

    With ``left=False`` rows are right-padded and a longer row keeps its first ``width`` items; with
    ``left=True`` rows are left-padded and a longer row keeps its last ``width`` items.

    Returns ``(values, valid)`` where ``valid`` is a boolean array, True on the cells holding row
    data.
    """
    out = np.full((len(rows), width), fill, dtype=dtype)
    keep = np.asarray(fill_rows(out, rows, left=left), dtype=np.int64)
    cols = np.arange(width)
    valid = cols[None, :] >= (width - keep)[:, None] if left else cols[None, :] < keep[:, None]
    return out, valid


def _check_lengths(outputs: list[AgentLoopOutput], calculate_log_probs: bool) -> None:
    """Raise :class:`DatasetError` when a row's mask or log-probs do not align with its response
    ids."""
    n_ids = _lengths([o.response_ids for o in outputs])
    n_mask = _lengths([o.response_mask for o in outputs])
    bad = np.flatnonzero(n_ids != n_mask)
    if bad.size:
        i = int(bad[0])
        raise DatasetError(
            f"output {i}: response_mask has {n_mask[i]} entries but response_ids has {n_ids[i]}; "
            "the agent loop must append one mask value per response token"
        )
    versions = [o.response_weight_versions for o in outputs]
    if any(v is not None for v in versions):
        _check_aligned(versions, n_ids, "response_weight_versions", "-1")
    if not calculate_log_probs:
        return
    logprobs = [o.response_logprobs for o in outputs]
    if all(v is not None for v in logprobs) and not (
        _lengths(cast("list[list[float]]", logprobs)) != n_ids
    ).any():
        return  # every row has log-probs of the right length: one vector compare
    _check_aligned(logprobs, n_ids, "response_logprobs", "0.0")


def _check_aligned(rows: list[Any], n_ids: np.ndarray, name: str, filler: str) -> None:
    """Raise :class:`DatasetError` for the first row of ``name`` (None: none) whose length differs
    from its ``n_ids`` response ids; ``filler``: the value for tokens the policy did not sample."""
    for i, v in enumerate(rows):
        if v is not None and len(v) != n_ids[i]:
            raise DatasetError(
                f"output {i}: {name} has {len(v)} entries but response_ids has {n_ids[i]}; "
                f"use {filler} for tokens the policy did not sample"
            )


def _all_ones(rows: list[Any]) -> bool:
    """Whether every row is a list or tuple whose items all equal 1 (``count`` runs in C)."""
    return set(map(type, rows)) <= _SEQUENCES and list(map(_COUNT_ONES, rows)) == list(
        map(len, rows)
    )


def _tensor_columns(
    outputs: list[AgentLoopOutput], prompt_length: int, response_length: int, pad_token_id: int,
    calculate_log_probs: bool, rewards_configured: bool = False,
    routed_experts_shape: tuple[int, int] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """Build every tensor column of docs/concepts.md#the-output-layout, and the reward columns'
    non-tensor companions (empty without a reward source)."""
    batch, width = len(outputs), prompt_length + response_length
    prompts = np.full((batch, prompt_length), pad_token_id, dtype=np.int64)
    kept_prompt = np.asarray(
        fill_rows(prompts, [o.prompt_ids for o in outputs], left=True), dtype=np.int64
    )
    responses = np.full((batch, response_length), pad_token_id, dtype=np.int64)
    kept_response = np.asarray(
        fill_rows(responses, [o.response_ids for o in outputs]), dtype=np.int64
    )
    masks = [o.response_mask for o in outputs]
    if _all_ones(masks):  # the common mask: ones on each row's kept response cells
        response_mask = np.empty((batch, response_length), dtype=np.int64)
        np.less(np.arange(response_length), kept_response[:, None], out=response_mask,
                casting="unsafe")
    else:
        response_mask = np.zeros((batch, response_length), dtype=np.int64)
        fill_rows(response_mask, masks)
    # Real tokens are the contiguous span [start, start + total) of each row; position = column
    # - start, clipped to [0, total - 1]; all three steps write straight into the outputs.
    start, total = prompt_length - kept_prompt, kept_prompt + kept_response
    position = np.empty((batch, width), dtype=np.int64)
    np.subtract(np.arange(width, dtype=np.int64), start[:, None], out=position)
    attention = np.empty((batch, width), dtype=np.int64)
    np.less(
        position.view(np.uint64), total.astype(np.uint64)[:, None], out=attention, casting="unsafe"
    )
    np.clip(position, 0, np.maximum(total - 1, 0)[:, None], out=position)
    cols = {
        "prompts": prompts, "responses": responses, "response_mask": response_mask,
        "input_ids": np.concatenate([prompts, responses], axis=1), "attention_mask": attention,
        "position_ids": position,
    }
    if calculate_log_probs:
        cols["rollout_log_probs"] = np.zeros((batch, response_length), dtype=np.float32)
        fill_rows(cols["rollout_log_probs"], [_or_empty(o.response_logprobs) for o in outputs])
    if any(o.response_weight_versions is not None for o in outputs):
        cols["rollout_weight_versions"] = np.full((batch, response_length), -1, dtype=np.int64)
        fill_rows(
            cols["rollout_weight_versions"],
            [_or_empty(o.response_weight_versions) for o in outputs],
        )
    routed = pad_routed_experts(outputs, start, kept_prompt, total, width, routed_experts_shape)
    if routed is not None:  # routing replay (R3): verl's layout, aligned with input_ids
        cols[ROUTED_EXPERTS_KEY] = routed
    reward_non_tensor: dict[str, np.ndarray] = {}
    if rewards_configured or any(o.reward_score is not None for o in outputs):
        resp_valid = np.arange(response_length)[None, :] < kept_response[:, None]
        reward_tensors, reward_non_tensor = reward_columns(outputs, resp_valid)
        cols.update(reward_tensors)
    return {
        k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in cols.items()
    }, reward_non_tensor


def _extra_columns(
    outputs: list[AgentLoopOutput], base: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """One object column per ``extra_fields`` key; rows lacking a key keep ``base[key]`` or None."""
    fields = [o.extra_fields for o in outputs]
    keys = list(dict.fromkeys(chain.from_iterable(fields)))
    plain = all(type(f) is dict for f in fields)
    columns: dict[str, np.ndarray] = {}
    for key in keys:
        if plain:
            try:  # every row has the key (the common case): one C-level pass
                columns[key] = object_array(list(map(itemgetter(key), fields)))
                continue
            except KeyError:
                pass
        fallback = base.get(key)
        values: list[Any] = []
        for i, o in enumerate(outputs):
            if key in o.extra_fields:
                values.append(o.extra_fields[key])
            elif fallback is None:
                values.append(None)
            else:
                values.append(fallback[i])
        columns[key] = object_array(values)
    return columns


def _sample_columns(sample_fields: dict[str, Any] | None, batch_size: int) -> dict[str, np.ndarray]:
    """Validate ``sample_fields`` (one value per output row) and return them as numpy arrays."""
    columns: dict[str, np.ndarray] = {}
    for key, value in (sample_fields or {}).items():
        arr = value if isinstance(value, np.ndarray) else object_array(list(value))
        if len(arr) != batch_size:
            raise DatasetError(
                f"sample_fields[{key!r}] has {len(arr)} rows but there are {batch_size} outputs; "
                "repeat each sample's value once per trajectory before calling postprocess"
            )
        columns[key] = arr
    return columns


def episode_columns(
    outputs: Sequence[AgentLoopOutput], trajectory_counts: Sequence[int] | None = None
) -> dict[str, np.ndarray]:
    """``trajectory_index``, ``num_trajectories`` and ``session_id`` for ``outputs``, whose first
    ``trajectory_counts[0]`` rows are one sample's trajectories, the next ``trajectory_counts[1]``
    the next sample's, and so on (None: one row per sample).  A sample's ``session_id`` is the first
    of its rows' ``extra_fields["session_id"]``, else a fresh uuid4 hex.

    Raises:
        DatasetError: the counts do not add up to ``len(outputs)`` or one is below 1.
    """
    counts = np.ones(len(outputs), dtype=np.int64) if trajectory_counts is None else \
        np.asarray(list(trajectory_counts), dtype=np.int64)
    if int(counts.sum()) != len(outputs) or (counts < 1).any():
        raise DatasetError(
            f"trajectory_counts {counts.tolist()} must be >= 1 each and add "
            f"up to the "
            f"{len(outputs)} outputs (one count per sample, its trajectories "
            f"consecutive)"
        )
    if (counts == 1).all():  # one row per sample
        return _single_episode_columns(outputs)
    starts = np.cumsum(counts) - counts
    index = np.arange(len(outputs)) - np.repeat(starts, counts)
    ids: list[str] = []
    for start, count in zip(starts.tolist(), counts.tolist(), strict=True):
        given = None
        for o in outputs[start:start + count]:
            given = o.extra_fields.get("session_id")
            if given is not None:
                break
        ids.extend([fresh_hex() if given is None else str(given)] * count)
    return {
        "trajectory_index": index.astype(np.int32),
        "num_trajectories": np.repeat(counts, counts).astype(np.int32),
        "session_id": object_array(ids),
    }


def _single_episode_columns(outputs: Sequence[AgentLoopOutput]) -> dict[str, np.ndarray]:
    """:func:`episode_columns` when each row is its own sample: index 0 of 1, the row's own
    ``session_id`` (else a fresh one, drawn in row order)."""
    n = len(outputs)
    given = [o.extra_fields.get("session_id") for o in outputs]
    return {
        "trajectory_index": np.zeros(n, dtype=np.int32),
        "num_trajectories": np.ones(n, dtype=np.int32),
        "session_id": object_array([fresh_hex() if g is None else str(g) for g in given]),
    }


def _non_tensor_columns(
    outputs: list[AgentLoopOutput], sample_fields: dict[str, Any] | None,
    reward: dict[str, np.ndarray], trajectory_counts: Sequence[int] | None = None,
) -> tuple[dict[str, np.ndarray], list[str]]:
    """Build every non-tensor column, with the precedence of docs/concepts.md#the-output-layout;
    returns them and the ``reward_extra_info`` keys."""
    columns = _sample_columns(sample_fields, len(outputs))
    columns.update(_extra_columns(outputs, columns))
    extra_keys: list[str] = []
    if reward:
        reward_extra, extra_keys = reward_extra_columns(outputs, columns)
        columns.update(reward_extra)
        columns.update(reward)
    columns["__num_turns__"] = np.array([o.num_turns for o in outputs], dtype=np.int32)
    columns["status"] = object_array([
        s._value_ if type(s) is RolloutStatus else getattr(s, "value", s)
        for s in [o.status for o in outputs]
    ])
    columns["error"] = object_array([o.error for o in outputs])
    columns.update(episode_columns(outputs, trajectory_counts))
    if any(o.multi_modal_data is not None for o in outputs):
        columns["multi_modal_data"] = object_array([o.multi_modal_data for o in outputs])
    return columns, extra_keys


def postprocess(
    outputs: list[AgentLoopOutput], *, prompt_length: int, response_length: int, pad_token_id: int,
    sample_fields: dict[str, np.ndarray] | None = None, calculate_log_probs: bool = False,
    rewards_configured: bool = False, trajectory_counts: Sequence[int] | None = None,
    routed_experts_shape: tuple[int, int] | None = None,
) -> DataProto:
    """Pad ``outputs`` (one row per trajectory) into verl's rollout layout.

    Args:
        outputs: trajectories in row order; several may come from the same sample.
        prompt_length: width P of ``prompts`` (left-padded; a longer prompt keeps its tail).
        response_length: width R of ``responses`` (right-padded; a longer response keeps its head).
        pad_token_id: the id in padded cells of ``prompts``, ``responses`` and ``input_ids``.
        sample_fields: per-row ``non_tensor_batch`` columns (e.g. ``uid``), entry ``i`` for
        ``outputs[i]``. calculate_log_probs: add ``rollout_log_probs`` (0.0 on rows without
        log-probs). rewards_configured: add the reward columns even when no row has a
        ``reward_score``. trajectory_counts: consecutive ``outputs`` per sample, for the episode
        columns; None: one each. routed_experts_shape: ``(layers, top_k)`` with routing replay
        on: ``routed_experts`` is built for every row (:mod:`agentloop.batch.routed_experts`).

    Returns:
        A DataProto of ``len(outputs)`` rows (columns: docs/concepts.md#the-output-layout).

    Raises:
        DatasetError: a row's ``response_mask`` / ``response_logprobs`` length differs from its
            ``response_ids``, a ``sample_fields`` column has the wrong length, ``trajectory_counts``
            does not add up, or a width is negative.
    """
    if prompt_length < 0 or response_length < 0:
        raise DatasetError(
            f"prompt_length and response_length must be >= 0, got "
            f"{prompt_length}, {response_length}"
        )
    _check_lengths(outputs, calculate_log_probs)
    tensors, reward = _tensor_columns(
        outputs, prompt_length, response_length, pad_token_id, calculate_log_probs,
        rewards_configured, routed_experts_shape,
    )
    batch = TensorDict(tensors, batch_size=[len(outputs)])
    non_tensor, extra_keys = _non_tensor_columns(outputs, sample_fields, reward, trajectory_counts)
    # a plain AgentLoopMetrics (fields only, all scalars): a copy of its __dict__, the same dict as
    # model_dump() without pydantic's serializer (~0.6 µs a row)
    meta_info: dict[str, Any] = {"metrics": [
        dict(m.__dict__) if type(m) is AgentLoopMetrics else m.model_dump()
        for m in [o.metrics for o in outputs]
    ]}
    if reward:
        meta_info["reward_extra_keys"] = extra_keys
    return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta_info)


def _layout(part: DataProto) -> tuple[Any, ...]:
    """What must agree for padded parts to join into what one :func:`postprocess` call gives:
    each column's name (in order), dtype and row shape, the meta_info keys and the reward extras."""
    tensors = part.batch.items() if part.batch is not None else ()
    return (
        tuple((k, v.dtype, tuple(v.shape[1:])) for k, v in tensors),
        tuple((k, v.dtype, v.shape[1:]) for k, v in part.non_tensor_batch.items()),
        tuple(part.meta_info), tuple(part.meta_info.get("reward_extra_keys") or ()),
    )


def join_padded(parts: Sequence[DataProto]) -> DataProto | None:
    """Consecutive runs of rows, each padded by :func:`postprocess` with the same arguments, as one
    DataProto equal to padding all the rows in one call (rows are padded each on its own; only
    which columns exist and their order depend on the rows together).

    Returns:
        The joined rows (``meta_info["metrics"]``: every part's, in row order), or None when the
        parts' layouts differ (e.g. an ``extra_fields`` key only some runs have): pad the rows
        again in one call then.
    """
    if len({_layout(p) for p in parts}) != 1:
        return None
    metrics = [m for p in parts for m in p.meta_info.get("metrics", [])]
    bare = [
        DataProto(p.batch, p.non_tensor_batch, {k: v for k, v in p.meta_info.items()
                                                  if k != "metrics"})
        for p in parts
    ]
    joined = DataProto.concat(bare)
    joined.meta_info = {"metrics": metrics, **joined.meta_info}
    return joined


__all__ = [
    "EPISODE_COLUMNS", "episode_columns", "fill_rows", "join_padded", "pad_rows", "postprocess",
]
