"""types.unchecked and replaced: hot-path models equal the validated ones as callers see them."""

from __future__ import annotations

import pickle

import pytest

from agentloop.types import (
    AgentLoopMetrics,
    AgentLoopOutput,
    RolloutStatus,
    StopReason,
    TokenOutput,
    unchecked,
)

CASES = [
    (TokenOutput, {"token_ids": [5, 6, 2], "log_probs": [-0.1, -0.2, -0.3],
                   "stop_reason": StopReason.STOP, "num_preempted": 0,
                   "extra_fields": {"global_steps": 3}}),
    (TokenOutput, {"token_ids": []}),
    (AgentLoopMetrics, {"generate_sequences": 0.25, "num_preempted": 0}),
    (AgentLoopMetrics, {}),
    (AgentLoopOutput, {"prompt_ids": [1, 2], "response_ids": [3, 4], "response_mask": [1, 0],
                       "response_logprobs": [-0.5, 0.0], "num_turns": 2,
                       "metrics": AgentLoopMetrics(generate_sequences=0.1),
                       "extra_fields": {"prompt_truncated": 0}, "status": RolloutStatus.LENGTH}),
]


@pytest.mark.parametrize("cls,values", CASES)
def test_same_as_validated(cls, values):
    fast, checked = unchecked(cls, **values), cls(**values)
    assert fast == checked
    assert repr(fast) == repr(checked)  # field order kept
    assert fast.model_dump() == checked.model_dump()
    assert fast.model_fields_set == checked.model_fields_set
    assert pickle.loads(pickle.dumps(fast)) == checked
    assert fast.model_copy(update={}) == checked


def test_default_factories_give_fresh_objects():
    a = unchecked(AgentLoopOutput, prompt_ids=[], response_ids=[], response_mask=[])
    b = unchecked(AgentLoopOutput, prompt_ids=[], response_ids=[], response_mask=[])
    assert a.extra_fields == {} and a.extra_fields is not b.extra_fields
    assert a.metrics == AgentLoopMetrics() and a.metrics is not b.metrics
    a.metrics.tool_calls += 1.0  # assignment still works on an unchecked model
    assert b.metrics.tool_calls == 0.0


def test_unknown_or_missing_fields_raise():
    with pytest.raises(TypeError, match=r"no field\(s\) \['bogus'\]"):
        unchecked(TokenOutput, token_ids=[1], bogus=1)
    with pytest.raises(TypeError, match=r"required field\(s\) \['token_ids'\]"):
        unchecked(TokenOutput, log_probs=None)


@pytest.mark.parametrize("cls,values", CASES)
def test_replaced_is_model_copy(cls, values):
    from agentloop.types import replaced

    original = cls(**values)
    change = {"extra_fields": {"server_index": 2}} if "extra_fields" in cls.model_fields else {
        "tool_calls": 1.5}
    fast, slow = replaced(original, **change), original.model_copy(update=change)
    assert fast == slow and repr(fast) == repr(slow)
    assert fast.model_fields_set == slow.model_fields_set
    assert original == cls(**values)  # the original is untouched
    with pytest.raises(TypeError, match="bogus"):
        replaced(original, bogus=1)
