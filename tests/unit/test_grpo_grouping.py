"""agentloop.batch.grpo.group_advantages against a hand-computed example: an episode counts once
in its group."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from agentloop.batch.grpo import group_advantages
from agentloop.batch.protocol import DataProto
from agentloop.errors import DatasetError

R = 4
SQRT3 = math.sqrt(3.0)


def batch(rows: list[tuple[str, str, int, float, int, str]]) -> DataProto:
    """rows: (uid, session_id, trajectory_index, score, reward_valid, status); the score sits on the
    row's last response token (verl's rm_scores layout), the response is 2 tokens long."""
    n = len(rows)
    scores = torch.zeros(n, R)
    scores[:, 1] = torch.tensor([r[3] for r in rows])
    mask = torch.zeros(n, R, dtype=torch.int64)
    mask[:, :2] = 1
    tensors = {
        "rm_scores": scores, "reward_valid": torch.tensor([r[4] for r in rows], dtype=torch.int8),
        "response_mask": mask,
    }
    col = lambda i: np.array([r[i] for r in rows], dtype=object)  # noqa: E731
    nt = {
        "uid": col(0), "session_id": col(1),
        "trajectory_index": np.array([r[2] for r in rows], dtype=np.int32), "status": col(5),
    }
    return DataProto(batch=TensorDict(tensors, batch_size=[n]), non_tensor_batch=nt, meta_info={})


# group g: episode a has 3 trajectories (all scored 1: reward_to=all), episodes b and c one each,
# scored 0;
# c also has an invalid row (reward_valid 0) and d is a failed sample: both are left out.
# group h: one episode (2 trajectories scored 0.5): a group of one has mean 0, std 1 (verl).
ROWS = [
    ("g", "a", 0, 1.0, 1, "stop"), ("g", "a", 1, 1.0, 1, "stop"), ("g", "a", 2, 1.0, 1, "stop"),
    ("g", "b", 0, 0.0, 1, "stop"), ("g", "c", 0, 0.0, 1, "stop"), ("g", "c", 1, 0.0, 0, "stop"),
    ("g", "d", 0, 0.0, 1, "error"), ("h", "e", 0, 0.5, 1, "stop"), ("h", "e", 1, 0.5, 1, "stop"),
]


def test_each_episode_counts_once():
    out = group_advantages(batch(ROWS), by="uid", episode_weight="mean", epsilon=0.0)
    # episode scores in g: a = 1, b = 0, c = 0 -> mean 1/3, std (ddof 1) sqrt(1/3) = 1/sqrt(3)
    up, down = (1 - 1 / 3) * SQRT3, (0 - 1 / 3) * SQRT3  # 1.1547, -0.5774
    expected = [up, up, up, down, down, 0.0, 0.0, 0.5, 0.5]
    assert out.advantages.tolist() == pytest.approx(expected, abs=1e-6)
    assert out.weights.tolist() == pytest.approx([1 / 3] * 3 + [1.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    assert out.valid.tolist() == [True] * 5 + [False, False, True, True]
    assert out.token_advantages[0].tolist() == pytest.approx([up, up, 0.0, 0.0], abs=1e-6)


def test_row_level_grpo_counts_trajectories():
    """episode_weight="none" is verl's row-level GRPO: a's three rows pull the mean up to 0.6."""
    out = group_advantages(batch(ROWS), episode_weight="none")
    sigma = math.sqrt(0.3)  # scores [1, 1, 1, 0, 0]: mean 0.6, sum of squares 1.2 over 4
    # h: two rows, equal scores
    expected = [0.4 / sigma] * 3 + [-0.6 / sigma] * 2 + [0.0, 0.0] + [0.0, 0.0]
    assert out.advantages.tolist() == pytest.approx(expected, abs=1e-5)
    assert out.weights.tolist() == [1.0] * 5 + [0.0, 0.0, 1.0, 1.0]


def test_last_uses_the_final_trajectory_and_per_row_keeps_own_scores():
    """reward_to=last puts a's reward on its final trajectory only; "last" reads that one (verl's
    session-level GRPO) and broadcasts the episode's advantage to all of a's rows."""

    def score(session: str, turn: int, own: float) -> float:
        if session != "a":
            return own
        return 1.0 if turn == 2 else 0.0

    rows = [(u, s, t, score(s, t, sc), v, st) for u, s, t, sc, v, st in ROWS]
    last = group_advantages(batch(rows), episode_weight="last", epsilon=0.0)
    assert last.advantages.tolist() == pytest.approx(
        group_advantages(batch(ROWS), episode_weight="mean", epsilon=0.0).advantages.tolist(),
        abs=1e-6,
    )
    # a scores 1/3 on average
    mean = group_advantages(batch(rows), episode_weight="mean", epsilon=0.0)
    assert mean.advantages[0].item() == pytest.approx(
        (1 / 3 - 1 / 9) / np.std([1 / 3, 0, 0], ddof=1), abs=1e-6
    )
    own = group_advantages(batch(rows), episode_weight="last", per_row=True, epsilon=0.0)
    assert own.advantages[:3].tolist() == pytest.approx(
        [-1 / 3 * SQRT3, -1 / 3 * SQRT3, 2 / 3 * SQRT3], abs=1e-6
    )


def test_dr_grpo_only_subtracts_the_mean():
    out = group_advantages(batch(ROWS), norm_by_std=False)
    assert out.advantages[:5].tolist() == pytest.approx([2 / 3] * 3 + [-1 / 3] * 2, abs=1e-6)


def test_missing_inputs_are_named():
    data = batch(ROWS)
    with pytest.raises(ValueError, match="episode_weight"):
        group_advantages(data, episode_weight="sum")
    with pytest.raises(DatasetError, match="'prompt_id'"):
        group_advantages(data, by="prompt_id")
    data.batch.pop("rm_scores")
    with pytest.raises(DatasetError, match="rm_scores"):
        group_advantages(data)
