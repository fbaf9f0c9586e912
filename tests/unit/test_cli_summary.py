"""What `agentloop rollout` prints at the end: the summary table and trajectories rendered for a
human."""

from __future__ import annotations

import numpy as np
import pytest

from agentloop.batch.postprocess import postprocess
from agentloop.cli.summary import format_table, pick_rows, render_trajectory, summary_rows
from agentloop.types import AgentLoopOutput, RolloutStatus


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from agentloop.testing.tiny_model import ensure_tiny_model

    return AutoTokenizer.from_pretrained(str(ensure_tiny_model()))


def rollout(tok):
    ids = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    call, tool, answer = ids("<tool_call>calc</tool_call>"), ids(" 816 "), ids("The answer is 816.")
    rows = [
        AgentLoopOutput(
            prompt_ids=ids("<|im_start|>user\nHow many?<|im_end|>\n<|im_start|>assistant\n"),
            response_ids=call + tool + answer,
            response_mask=[1] * len(call) + [0] * len(tool) + [1] * len(answer), reward_score=1.0,
            num_turns=4, extra_fields={"num_tool_calls": 1},
        ),
        AgentLoopOutput(
            prompt_ids=ids("<|im_start|>user\nHow many?<|im_end|>\n<|im_start|>assistant\n"),
            response_ids=ids("The answer is 3."), response_mask=[1] * len(ids("The answer is 3.")),
            reward_score=0.0, num_turns=2, extra_fields={"num_tool_calls": 0},
        ),
        AgentLoopOutput(
            prompt_ids=ids("x"), response_ids=[], response_mask=[], num_turns=0,
            status=RolloutStatus.ERROR, error="boom", extra_fields={"num_tool_calls": 0},
        ),
    ]
    return postprocess(
        rows, prompt_length=32, response_length=48, pad_token_id=0,
        sample_fields={"uid": np.array(["a", "b", "c"], dtype=object)}, rewards_configured=True,
    )


def test_the_table_has_the_numbers_a_user_looks_for(tok):
    table = dict(summary_rows(rollout(tok), wall=2.0, num_samples=3))
    assert table["samples"] == "3" and table["trajectories"] == "3"
    assert table["mean reward"].startswith("0.500 (2 rows scored)")  # the error row has no reward
    assert table["tool-call rate"].startswith("33% of trajectories (1 calls)")
    assert table["status"] == "stop 2, error 1"
    assert "tok/s" in table["sampled tokens"]
    text = format_table(list(table.items()))
    assert "mean reward" in text and "\033[" not in text  # no colour codes off a terminal


def test_a_trajectory_shows_sampled_and_inserted_tokens_apart(tok):
    text = render_trajectory(rollout(tok), 0, tok)
    lines = text.splitlines()
    assert lines[0] == "prompt (last user turn): How many?"
    assert [line.split()[0] for line in lines[1:4]] == ["[model]", "[tool]", "[model]"]
    assert "816" in lines[2] and "The answer is 816." in lines[3] and "reward 1" in lines[-1]
    assert "\033[32m" in render_trajectory(rollout(tok), 0, tok, colour=True)


def test_rows_shown_prefer_tool_calls_and_different_rewards(tok):
    assert pick_rows(rollout(tok), 2) == [0, 1]
    assert pick_rows(rollout(tok), 0) == []
