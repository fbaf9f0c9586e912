"""The reward columns of a rollout batch, and the one rule that builds them.

When a batch has any reward source (a configured reward function or tool rewards, or a row with a
``reward_score``), every row gets ``rm_scores`` [B, R] (the score on the last real response token),
``reward_valid`` [B] (1: the row has a finite reward) and ``reward_error`` (why not).  A row is
never given a value it did not earn: :func:`complete_reward_columns` gives a chunk without a reward
source the same columns with every row invalid.  Spec: docs/concepts.md#rewards (Columns,
Concatenating).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from agentloop.batch.protocol import DataProto, object_array
from agentloop.errors import DatasetError
from agentloop.types import AgentLoopOutput, RolloutStatus

REWARD_TENSORS = ("rm_scores", "reward_valid")
"""Tensor columns that exist together whenever a batch has a reward source."""
REWARD_ERROR = "reward_error"
REWARD_EXTRA_INFO = "reward_extra_info"
"""``extra_fields`` key holding a scorer's dict result (verl's ``reward_extra_info``)."""
UNFINISHED = frozenset({RolloutStatus.ERROR, RolloutStatus.TIMEOUT, RolloutStatus.ABORTED})
"""Statuses of rollouts that did not finish: a custom reward function is not called on them."""

NO_SOURCE = (
    "no reward: no reward source gave this row a score (set "
    "custom_reward_function, or have the "
    "agent loop set reward_score)"
)


def _is_valid(score: float | None) -> bool:
    return score is not None and math.isfinite(score)


def _reason(output: AgentLoopOutput) -> str:
    """Why a row without a reward has none, when nothing recorded a reason."""
    status = getattr(output.status, "value", output.status)
    if output.reward_score is not None:
        return f"no reward: the reward_score {output.reward_score} is not a finite number"
    if output.status in UNFINISHED:
        return f"no reward: the rollout ended with status {status!r} (see the error column)"
    return NO_SOURCE


def reward_columns(
    outputs: Sequence[AgentLoopOutput], resp_valid: np.ndarray
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(tensor columns, non-tensor columns)`` (docs/concepts.md#rewards) for padded ``outputs``.

    ``resp_valid`` is the ``[B, R]`` boolean mask of real response tokens.
    """
    n, width = resp_valid.shape
    valid = np.fromiter((_is_valid(o.reward_score) for o in outputs), dtype=np.int8, count=n)
    scores = np.zeros((n, width), dtype=np.float32)
    if width and n:
        last = np.maximum(resp_valid.sum(axis=1) - 1, 0)
        values = np.array(
            [o.reward_score if v else 0.0 for o, v in zip(outputs, valid, strict=True)],
            dtype=np.float32,
        )
        scores[np.arange(n), last] = values
    errors = [
        None if v else (o.extra_fields.get(REWARD_ERROR) or _reason(o))
        for o, v in zip(outputs, valid, strict=True)
    ]
    return {"rm_scores": scores, "reward_valid": valid}, {REWARD_ERROR: object_array(errors)}


def reward_extra_columns(
    outputs: Sequence[AgentLoopOutput], base: dict[str, np.ndarray] | None = None
) -> tuple[dict[str, np.ndarray], list[str]]:
    """verl's ``reward_extra_info``: one object column per key a scorer returned, and the keys in
    first-seen order (``meta_info['reward_extra_keys']``).  A row without the key keeps
    ``base[key]`` (the sample's or the loop's column of that name), else None."""
    infos = [o.extra_fields.get(REWARD_EXTRA_INFO) or {} for o in outputs]
    keys = list(dict.fromkeys(k for info in infos for k in info))
    base = base or {}
    columns = {}
    for key in keys:
        fallback = base.get(key)
        values: list[Any] = []
        for i, info in enumerate(infos):
            if key in info:
                values.append(info[key])
            elif fallback is None:
                values.append(None)
            else:
                values.append(fallback[i])
        columns[key] = object_array(values)
    return columns, keys


def complete_reward_columns(part: DataProto, rm_scores_like: torch.Tensor) -> None:
    """Give a worker's chunk the reward columns (docs/concepts.md#rewards; in place) before
    concatenation.

    ``rm_scores_like`` is another chunk's ``rm_scores`` (for the width and dtype).  A chunk
    without ``rm_scores`` had no reward source: every row gets ``rm_scores`` 0, ``reward_valid`` 0
    and a ``reward_error``.  A chunk with ``rm_scores`` but no ``reward_valid`` is in verl's layout:
    all valid.

    Raises:
        DatasetError: a chunk has ``reward_valid`` without ``rm_scores``.
    """
    if part.batch is None:
        raise DatasetError(
            "a worker chunk has no tensor batch; every chunk must come from postprocess()"
        )
    n = len(part)
    present = set(part.batch.keys())
    if "rm_scores" not in present:
        if "reward_valid" in present:
            raise DatasetError(
                "a worker chunk has reward_valid but no rm_scores; both come "
                "from postprocess() "
                "together, so a chunk built elsewhere must add rm_scores too"
            )
        part.batch["rm_scores"] = torch.zeros(
            (n, *rm_scores_like.shape[1:]), dtype=rm_scores_like.dtype
        )
        part.batch["reward_valid"] = torch.zeros(n, dtype=torch.int8)
        part.non_tensor_batch[REWARD_ERROR] = object_array(
            [_chunk_reason(part, i) for i in range(n)])
    elif "reward_valid" not in present:
        part.batch["reward_valid"] = torch.ones(n, dtype=torch.int8)
        part.non_tensor_batch.setdefault(REWARD_ERROR, object_array([None] * n))


def _chunk_reason(part: DataProto, i: int) -> str:
    status = part.non_tensor_batch.get("status")
    value = status[i] if status is not None else None
    if value in {s.value for s in UNFINISHED}:
        return f"no reward: the rollout ended with status {value!r} (see the error column)"
    return NO_SOURCE


__all__ = ["NO_SOURCE", "REWARD_ERROR", "REWARD_EXTRA_INFO", "REWARD_TENSORS", "UNFINISHED",
           "complete_reward_columns", "reward_columns", "reward_extra_columns"]
