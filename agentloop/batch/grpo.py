"""Group-normalised (GRPO) advantages where an episode with several trajectories counts once.

Rows sharing ``session_id`` are one episode, rows sharing ``uid`` one GRPO group.
:func:`group_advantages` scores each episode once in its group's mean and std (as verl's
session-level GRPO; ``episode_weight="none"`` is verl's row-level GRPO) and returns
:class:`GroupedAdvantages` (per-row advantages, loss weights that sum to 1 per episode, token
advantages, validity).  Rows with ``reward_valid`` 0 or an unfinished ``status`` are left out with
advantage and weight 0.  Raises :class:`~agentloop.errors.DatasetError` when a column is missing.
The math: docs/context.md#grouping-for-grpo.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from agentloop.batch.protocol import DataProto
from agentloop.errors import DatasetError

EPISODE_WEIGHTS = ("mean", "last", "none")
_UNFINISHED = frozenset({"error", "timeout", "aborted"})


@dataclass
class GroupedAdvantages:
    """What :func:`group_advantages` returns; every tensor has one entry (row) per batch row."""

    advantages: torch.Tensor
    """[B] float32: each row's advantage (0 on rows left out)."""
    weights: torch.Tensor
    """[B] float32: each row's loss weight, ``1 / valid rows of its episode`` (0 on rows left
    out)."""
    token_advantages: torch.Tensor
    """[B, R] float32: ``advantages`` on the row's ``response_mask`` tokens (verl's
    ``advantages`` layout)."""
    valid: torch.Tensor
    """[B] bool: the rows that took part in the statistics."""


def group_advantages(
    data: DataProto, by: str = "uid", episode_weight: str = "mean", *, per_row: bool = False,
    norm_by_std: bool = True, epsilon: float = 1e-6,
) -> GroupedAdvantages:
    """GRPO advantages of ``data`` (a rollout batch with ``rm_scores``) where each episode counts
    once in its group's mean and std; the math: docs/context.md#grouping-for-grpo.

    Args:
        data: rows with ``batch["rm_scores"]`` (a row's score is its sum) and
        ``non_tensor_batch[by]``;
            ``reward_valid``, ``status``, ``session_id`` and ``trajectory_index`` are used when
            present (without ``session_id`` every row is its own episode).
        by: the group column (GRPO's ``uid``).
        episode_weight: ``mean`` | ``last`` | ``none``: how an episode's score is formed from its
        rows. per_row: use each row's own score in its advantage (the statistics stay per episode).
        norm_by_std: divide by the group's std (GRPO); False: only subtract the mean (Dr.GRPO).
        epsilon: added to the std.

    Raises:
        DatasetError: ``rm_scores`` or the ``by`` column is missing.
        ValueError: ``episode_weight`` is not one of mean | last | none.
    """
    if episode_weight not in EPISODE_WEIGHTS:
        raise ValueError(
            f"episode_weight must be one of {' | '.join(EPISODE_WEIGHTS)}, got {episode_weight!r}"
        )
    tensors = list(data.batch.keys()) if data.batch is not None else []
    if "rm_scores" not in tensors:
        raise DatasetError(
            f"group_advantages needs batch['rm_scores'] (tensor keys: "
            f"{sorted(tensors)}); roll out "
            "with a reward source (custom_reward_function, or a loop that "
            "sets reward_score)"
        )
    nt = data.non_tensor_batch
    if by not in nt:
        raise DatasetError(
            f"group_advantages groups rows by non_tensor_batch[{by!r}], "
            f"which is missing (keys: "
            f"{sorted(nt)}); pass by= the column holding each prompt's group id"
        )
    assert data.batch is not None
    n = len(data)
    scores = data.batch["rm_scores"].sum(-1).double().numpy()
    valid = (
        np.ones(n, dtype=bool)
        if "reward_valid" not in tensors
        else data.batch["reward_valid"].numpy() != 0
    )
    if "status" in nt:
        valid &= np.array([s not in _UNFINISHED for s in nt["status"].tolist()], dtype=bool)
    groups = nt[by].tolist()
    sessions = (
        nt["session_id"].tolist()
        if "session_id" in nt and episode_weight != "none"
        else list(range(n))
    )
    order = (
        [0 if t is None else t for t in nt["trajectory_index"].tolist()]
        if "trajectory_index" in nt
        else [0] * n
    )
    episodes: dict[tuple[Any, Any], list[int]] = defaultdict(list)
    for r in np.flatnonzero(valid).tolist():
        episodes[(groups[r], sessions[r] if sessions[r] is not None else ("row", r))].append(r)
    episode_score = {
        key: _episode_score(rows, scores, order, episode_weight) for key, rows in episodes.items()
    }
    by_group: dict[Any, list[float]] = defaultdict(list)
    for (group, _), value in episode_score.items():
        by_group[group].append(value)
    stats = {group: _mean_std(values) for group, values in by_group.items()}
    advantages, weights = np.zeros(n), np.zeros(n)
    for key, rows in episodes.items():
        mu, sigma = stats[key[0]]
        for r in rows:
            value = scores[r] if per_row else episode_score[key]
            scale = sigma + epsilon if norm_by_std else 1.0
            # sigma = epsilon = 0: all scores equal
            advantages[r] = (value - mu) / scale if scale > 0 else 0.0
            weights[r] = 1.0 / len(rows)
    adv = torch.from_numpy(advantages).float()
    mask = (
        data.batch["response_mask"]
        if "response_mask" in tensors
        else torch.ones_like(data.batch["rm_scores"])
    )
    return GroupedAdvantages(
        advantages=adv, weights=torch.from_numpy(weights).float(),
        token_advantages=adv.unsqueeze(-1) * mask.float(), valid=torch.from_numpy(valid),
    )


def _episode_score(
    rows: list[int], scores: np.ndarray, order: list[Any], episode_weight: str
) -> float:
    if episode_weight == "last":
        return float(scores[max(rows, key=lambda r: (order[r], r))])
    return float(np.mean(scores[rows]))


def _mean_std(values: list[float]) -> tuple[float, float]:
    """verl's group statistics: (0, 1) for a group of one, else the mean and the Bessel-corrected
    std."""
    if len(values) == 1:
        return 0.0, 1.0
    arr = np.asarray(values, dtype=np.float64)
    return float(arr.mean()), float(arr.std(ddof=1))


__all__ = ["EPISODE_WEIGHTS", "GroupedAdvantages", "group_advantages"]
