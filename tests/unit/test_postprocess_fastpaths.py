"""postprocess's fast paths (all-ones masks, full-width rows, extra_fields keys every row has, one
row per sample), to_episode's and TrajectoryScorer.score's for one plain trajectory give what the
general paths give."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from agentloop.batch.postprocess import episode_columns, fill_rows, postprocess
from agentloop.errors import DatasetError
from agentloop.rewards.loader import RewardFunctionConfig
from agentloop.rewards.scoring import TrajectoryScorer
from agentloop.rollout.episodes import to_episode
from agentloop.types import AgentLoopOutput, MultiTrajectoryAgentLoopOutput, RolloutStatus


class _Fields(dict):
    """A dict subclass: postprocess takes its general (per-cell) path for extra_fields."""


def _outputs(n: int, *, general: bool, full: bool = False) -> list[AgentLoopOutput]:
    """``n`` rows with all-ones masks, log-probs and shared extra_fields keys; ``general`` gives
    the same values in forms the fast paths skip (numpy masks, dict subclasses)."""
    rows = []
    for i in range(n):
        r = 4 if full else i % 5
        mask: Any = np.ones(r, dtype=np.int64) if general else [1] * r
        fields: dict[str, Any] = {"k": i, "session_id": f"s{i}"}
        if i % 3 == 0:
            fields["odd"] = "x"
        out = AgentLoopOutput(
            prompt_ids=list(range(i % 4)), response_ids=list(range(1, r + 1)),
            response_mask=[1] * r, response_logprobs=[-0.5] * r,
            extra_fields=_Fields(fields) if general else fields,
            status=RolloutStatus.LENGTH if i % 2 else RolloutStatus.STOP,
        )
        out.response_mask = mask
        rows.append(out)
    return rows


def _dump(batch: Any) -> tuple[Any, ...]:
    tensors = {k: (v.dtype, v.tolist()) for k, v in batch.batch.items()}
    non_tensor = {k: (v.dtype, v.tolist()) for k, v in batch.non_tensor_batch.items()}
    return tensors, non_tensor, list(batch.batch.keys()), batch.meta_info


@pytest.mark.parametrize("full", [False, True])
def test_fast_paths_equal_general_paths(full: bool) -> None:
    kw = {"prompt_length": 3, "response_length": 4, "pad_token_id": 7,
          "calculate_log_probs": True, "sample_fields": {"k": np.arange(9) + 100}}
    fast = postprocess(_outputs(9, general=False, full=full), **kw)
    general = postprocess(_outputs(9, general=True, full=full), **kw)
    assert _dump(fast) == _dump(general)
    # rows lacking "odd" get None; rows with "k" keep their own over sample_fields
    assert fast.non_tensor_batch["odd"].tolist() == ["x" if i % 3 == 0 else None for i in range(9)]
    assert fast.non_tensor_batch["k"].tolist() == list(range(9))
    assert fast.non_tensor_batch["status"].tolist() == [
        "length" if i % 2 else "stop" for i in range(9)
    ]


def test_mixed_masks_and_full_width_fill() -> None:
    rows = _outputs(6, general=False)
    rows[2].response_mask = [1, 0]  # one row not all ones: the general fill for every row
    out = postprocess(rows, prompt_length=3, response_length=4, pad_token_id=0)
    assert out.batch["response_mask"][2].tolist() == [1, 0, 0, 0]
    assert out.batch["response_mask"][4].tolist() == [1, 1, 1, 1]
    values = np.zeros((3, 2), dtype=np.int64)
    assert fill_rows(values, [[1, 2], [3, 4, 5], (6, 7)], left=True) == [2, 2, 2]
    assert values.tolist() == [[1, 2], [4, 5], [6, 7]]
    strided = np.zeros((3, 4), dtype=np.int64)[:, ::2]
    fill_rows(strided, [[1, 2], [3, 4], [5, 6]])
    assert strided.tolist() == [[1, 2], [3, 4], [5, 6]]


def test_one_row_per_sample_episode_columns() -> None:
    rows = _outputs(4, general=False)
    rows[1].extra_fields = {}
    cols = episode_columns(rows, [1, 1, 1, 1])
    assert cols["trajectory_index"].dtype == np.int32
    assert cols["trajectory_index"].tolist() == [0] * 4
    assert cols["num_trajectories"].dtype == np.int32
    assert cols["num_trajectories"].tolist() == [1] * 4
    ids = cols["session_id"].tolist()
    assert ids[0] == "s0" and ids[2:] == ["s2", "s3"] and len(ids[1]) == 32
    assert episode_columns(rows)["session_id"].tolist()[2:] == ["s2", "s3"]
    with pytest.raises(DatasetError, match="must be >= 1 each"):
        episode_columns(rows, [1, 1, 1])


def test_to_episode_plain_output_fields_set() -> None:
    plain = AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1])
    given = AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1],
                            extra_fields={"session_id": "abc", "x": 1})
    (a,) = to_episode(plain, "loop")
    assert "extra_fields" in a.model_fields_set and len(a.extra_fields["session_id"]) == 32
    assert a.model_dump(exclude_unset=True)["extra_fields"] == a.extra_fields
    (b,) = to_episode(given, "loop")
    assert b.extra_fields == {"session_id": "abc", "x": 1}
    (c,) = to_episode([given], "loop")
    assert c.extra_fields == {"session_id": "abc", "x": 1}
    bad = AgentLoopOutput(prompt_ids=[1], response_ids=[2, 3], response_mask=[1])
    (d,) = to_episode(bad, "loop")
    assert d.status == RolloutStatus.ERROR and "malformed" in (d.error or "")
    fresh = AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1])
    multi = MultiTrajectoryAgentLoopOutput(trajectories=[fresh, given])
    episode = to_episode(multi, "loop")
    assert isinstance(episode, MultiTrajectoryAgentLoopOutput)
    assert [t.extra_fields["session_id"] for t in episode.trajectories] == ["abc", "abc"]


def test_score_one_plain_trajectory_as_general_path() -> None:
    scorer = TrajectoryScorer(RewardFunctionConfig(), tokenizer=None)

    def trajectory(score: float | None) -> AgentLoopOutput:
        return AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1],
                               reward_score=score, extra_fields={"session_id": "s"})

    for score in (None, 0.5):
        (fast,) = asyncio.run(scorer.score([trajectory(score)], {}))
        multi = MultiTrajectoryAgentLoopOutput(trajectories=[trajectory(score)])
        (general,) = asyncio.run(scorer.score(multi, {}))
        assert fast.model_dump() == general.model_dump()
        assert fast.model_fields_set == general.model_fields_set
        assert "reward_score" in fast.model_fields_set
