"""postprocess: AgentLoopOutputs padded into verl's layout, checked against hand-worked tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agentloop.batch.postprocess import pad_rows, postprocess
from agentloop.errors import DatasetError
from agentloop.types import AgentLoopMetrics, AgentLoopOutput, RolloutStatus

PAD = 9


def three_outputs() -> list[AgentLoopOutput]:
    """A: short prompt, tool token in the response. B: prompt and response too long. C: failed,
    empty response."""
    return [
        AgentLoopOutput(
            prompt_ids=[11, 12], response_ids=[21, 22], response_mask=[1, 0],
            response_logprobs=[-0.5, 0.0], reward_score=1.0, num_turns=3,
            metrics=AgentLoopMetrics(generate_sequences=0.1, tool_calls=0.2),
        ),
        AgentLoopOutput(
            prompt_ids=[31, 32, 33, 34, 35], response_ids=[41, 42, 43, 44],
            response_mask=[1, 1, 1, 1], response_logprobs=[-1.0, -2.0, -3.0, -4.0],
            reward_score=0.5, num_turns=2, status=RolloutStatus.LENGTH,
        ),
        AgentLoopOutput(
            prompt_ids=[51], response_ids=[], response_mask=[], reward_score=0.25,
            status=RolloutStatus.ERROR, error="boom",
        ),
    ]


def run(outputs: list[AgentLoopOutput], **kw):
    kw = {"prompt_length": 4, "response_length": 3, "pad_token_id": PAD, **kw}
    return postprocess(outputs, **kw)


def test_hand_worked_layout() -> None:
    b = run(three_outputs()).batch
    assert b["prompts"].tolist() == [[PAD, PAD, 11, 12], [32, 33, 34, 35], [PAD, PAD, PAD, 51]]
    assert b["responses"].tolist() == [[21, 22, PAD], [41, 42, 43], [PAD, PAD, PAD]]
    assert b["input_ids"].tolist() == [
        [PAD, PAD, 11, 12, 21, 22, PAD], [32, 33, 34, 35, 41, 42, 43],
        [PAD, PAD, PAD, 51, PAD, PAD, PAD],
    ]
    assert b["attention_mask"].tolist() == [
        [0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 0, 0, 0],
    ]
    assert b["position_ids"].tolist() == [
        [0, 0, 0, 1, 2, 3, 3], [0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 0, 0],
    ]
    # The tool token (22) is attended to but not trained on; padding is neither.
    assert b["response_mask"].tolist() == [[1, 0, 0], [1, 1, 1], [0, 0, 0]]
    for key in (
        "prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
    ):
        assert b[key].dtype == torch.int64, key
    assert "rollout_log_probs" not in set(b.keys())


def test_log_probs_padding_and_missing_rows() -> None:
    lp = run(three_outputs(), calculate_log_probs=True).batch["rollout_log_probs"]
    assert lp.dtype == torch.float32
    assert lp.tolist() == [[-0.5, 0.0, 0.0], [-1.0, -2.0, -3.0], [0.0, 0.0, 0.0]]


def test_rm_scores_on_last_response_token() -> None:
    scores = run(three_outputs()).batch["rm_scores"]
    assert scores.dtype == torch.float32
    # Empty response: no last token, so the score goes to column 0 and the row still sums to it.
    assert scores.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.5], [0.25, 0.0, 0.0]]
    assert run(three_outputs()).batch["reward_valid"].tolist() == [1, 1, 1]


def test_a_row_without_reward_is_marked_not_dropped() -> None:
    """One missing score used to drop rm_scores for the whole batch; now the row is zero and
    invalid."""
    outputs = three_outputs()
    outputs[1].reward_score = None
    out = run(outputs)
    assert out.batch["rm_scores"].tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.25, 0.0, 0.0]]
    assert out.batch["reward_valid"].dtype == torch.int8 and out.batch["reward_valid"].tolist() == [
        1, 0, 1,
    ]
    assert out.non_tensor_batch["reward_error"][0] is None
    assert "no reward source" in out.non_tensor_batch["reward_error"][1]
    assert out.meta_info["reward_extra_keys"] == []
    outputs[1].reward_score = float("nan")  # a non-finite score is not a score
    assert run(outputs).batch["reward_valid"].tolist() == [1, 0, 1]


def test_reward_columns_follow_the_reward_source() -> None:
    no_scores = three_outputs()
    for o in no_scores:
        o.reward_score = None
    out = run(no_scores)
    assert "rm_scores" not in set(out.batch.keys()) and "reward_error" not in out.non_tensor_batch
    # a configured reward function: every row marked invalid
    out = run(no_scores, rewards_configured=True)
    assert out.batch["reward_valid"].tolist() == [0, 0, 0] and out.batch["rm_scores"].sum() == 0
    assert "status 'error'" in out.non_tensor_batch["reward_error"][2]


def test_reward_extra_info_becomes_verl_columns() -> None:
    outputs = three_outputs()
    outputs[0].extra_fields = {"reward_extra_info": {"score": 1.0, "pred": "72"}}
    outputs[1].extra_fields = {"reward_extra_info": {"score": 0.5, "acc": 0.0}}
    out = run(outputs, sample_fields={"pred": np.array(["s"] * 3, dtype=object)})
    assert out.meta_info["reward_extra_keys"] == ["score", "pred", "acc"]
    # the scorer's value wins over the sample's
    assert out.non_tensor_batch["pred"].tolist() == ["72", "s", "s"]
    assert out.non_tensor_batch["acc"].tolist() == [None, 0.0, None]


def test_non_tensor_columns_and_metrics() -> None:
    out = run(three_outputs())
    nt = out.non_tensor_batch
    assert nt["__num_turns__"].dtype == np.int32 and nt["__num_turns__"].tolist() == [3, 2, 0]
    assert nt["status"].tolist() == ["stop", "length", "error"]
    assert nt["error"].tolist() == [None, None, "boom"]
    assert "multi_modal_data" not in nt
    assert out.meta_info["metrics"][0] == {
        "generate_sequences": 0.1, "tool_calls": 0.2, "compute_score": 0.0, "num_preempted": -1,
    }
    assert len(out.meta_info["metrics"]) == 3


def test_mixed_multi_trajectory_keeps_sample_fields_and_extra_columns() -> None:
    outs = [
        AgentLoopOutput(
            prompt_ids=[1], response_ids=[2], response_mask=[1],
            extra_fields={"turn": 0, "tag": "x"},
        ),
        AgentLoopOutput(
            prompt_ids=[1, 2, 3], response_ids=[4], response_mask=[1], extra_fields={"turn": 1},
            multi_modal_data={"image": ["img"]},
        ),
        AgentLoopOutput(prompt_ids=[5], response_ids=[6, 7], response_mask=[1, 1]),
    ]
    uid = np.array(["s0", "s0", "s1"], dtype=object)
    tag = np.array(["from-sample"] * 3, dtype=object)
    nt = run(outs, sample_fields={"uid": uid, "tag": tag}).non_tensor_batch
    assert nt["uid"].tolist() == ["s0", "s0", "s1"]
    assert nt["turn"].tolist() == [0, 1, None]
    # A row that sets an extra field overrides the sample's value; the others keep it.
    assert nt["tag"].tolist() == ["x", "from-sample", "from-sample"]
    assert nt["multi_modal_data"].tolist() == [None, {"image": ["img"]}, None]
    with pytest.raises(DatasetError, match="'uid'"):
        run(outs, sample_fields={"uid": uid[:2]})


def test_all_empty_and_no_outputs() -> None:
    out = run(
        [
            AgentLoopOutput(
                prompt_ids=[], response_ids=[], response_mask=[], status=RolloutStatus.TIMEOUT
            )
        ]
    )
    assert out.batch["attention_mask"].sum() == 0 and out.batch["position_ids"].sum() == 0
    assert out.batch["input_ids"].tolist() == [[PAD] * 7]
    empty = run([], calculate_log_probs=True)
    assert len(empty) == 0 and empty.batch["input_ids"].shape == (0, 7)
    assert empty.batch["rollout_log_probs"].shape == (0, 3)


def test_misaligned_mask_or_logprobs_is_an_error() -> None:
    bad = AgentLoopOutput(prompt_ids=[1], response_ids=[2, 3], response_mask=[1])
    with pytest.raises(DatasetError, match="output 0: response_mask has 1 entries"):
        run([bad])
    bad = AgentLoopOutput(
        prompt_ids=[1], response_ids=[2, 3], response_mask=[1, 1], response_logprobs=[0.0]
    )
    run([bad])  # log-probs are not read unless asked for
    with pytest.raises(DatasetError, match="response_logprobs"):
        run([bad], calculate_log_probs=True)


def test_pad_rows_matches_a_naive_reference() -> None:
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 100, size=int(n)).tolist() for n in rng.integers(0, 12, size=200)]
    for left in (False, True):
        values, valid = pad_rows(rows, 6, -1, np.int64, left=left)
        for row, got, mask in zip(rows, values.tolist(), valid.tolist(), strict=True):
            kept = row[-6:] if left else row[:6]
            fill = [-1] * (6 - len(kept))
            assert got == (fill + kept if left else kept + fill)
            assert mask == [v != -1 for v in (fill + kept if left else kept + fill)]


def test_align_keys_builds_reward_columns_by_the_rule_and_never_zero_fills() -> None:
    from agentloop.batch.metrics import align_keys
    from agentloop.batch.protocol import DataProto

    scored = three_outputs()
    scored[0].extra_fields = {"reward_extra_info": {"score": 1.0, "acc": 1.0}}
    unscored = three_outputs()
    for o in unscored:
        o.reward_score = None
    a, b = run(scored), run(unscored)
    out = DataProto.concat(align_keys([a, b]))
    assert out.batch["rm_scores"].sum(-1).tolist() == [1.0, 0.5, 0.25, 0.0, 0.0, 0.0]
    assert out.batch["reward_valid"].tolist() == [1, 1, 1, 0, 0, 0]
    assert out.non_tensor_batch["reward_error"][3].startswith("no reward")
    assert out.meta_info["reward_extra_keys"] == ["score", "acc"]
    assert out.non_tensor_batch["acc"].tolist() == [1.0] + [None] * 5

    # rm_scores without reward_valid: verl emits it only when all rows scored
    verl_layout = run(three_outputs())
    verl_layout.batch.pop("reward_valid")
    verl_layout.non_tensor_batch.pop("reward_error")
    out = DataProto.concat(align_keys([verl_layout, run(unscored)]))
    assert out.batch["reward_valid"].tolist() == [1, 1, 1, 0, 0, 0]

    with_lp, without_lp = run(three_outputs(), calculate_log_probs=True), run(three_outputs())
    with pytest.raises(
        DatasetError,
        match=r"worker chunk 1 of 2 lacks the tensor column\(s\) " r"\['rollout_log_probs'\]",
    ):
        align_keys([with_lp, without_lp])


def test_stream_parts_with_their_own_timing_concatenate() -> None:
    """docs/async.md: `DataProto.concat(align_keys(parts))` joins `generate_sequences_stream` parts,
    each of which carries its own `meta_info["timing"]` (before, concat refused the differing
    values)."""
    from agentloop.batch.metrics import align_keys
    from agentloop.batch.protocol import DataProto

    a, b = run(three_outputs()), run(three_outputs())
    a.meta_info["timing"], b.meta_info["timing"] = (
        {"agent_loop/wall": 1.0},
        {"agent_loop/wall": 2.5},
    )
    out = DataProto.concat(align_keys([a, b]))
    # one part's timing would misdescribe the whole
    assert len(out) == 6 and "timing" not in out.meta_info
    same = [run(three_outputs()), run(three_outputs())]
    for p in same:
        p.meta_info["timing"] = {"agent_loop/wall": 1.0}
    assert DataProto.concat(align_keys(same)).meta_info["timing"] == {"agent_loop/wall": 1.0}
