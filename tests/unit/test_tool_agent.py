"""ToolAgentLoop state machine against ScriptedServer scripts (no Ray, no engine)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf

from agentloop.config import default_config
from agentloop.loops.tool_agent import ToolAgentLoop
from agentloop.routing import AsyncLLMServerManager
from agentloop.testing import FakeTokenizer, ScriptedServer
from agentloop.testing.fake_tokenizer import IM_END
from agentloop.tools import BaseTool, ToolResponse

TOK = FakeTokenizer()
RELEASED: list[str] = []


class SlowTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(5)
        return ToolResponse(text="never"), 0.0, {}

    async def release(self, instance_id, **kwargs):
        RELEASED.append(instance_id)


class BoomTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("kaboom")


class BigTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="x" * 5_000_000), 1.0, {}


def schema(name: str) -> str:
    return f"{{type: function, function: {{name: {name}, description: d}}}}"


@pytest.fixture
def tool_yaml(tmp_path):
    p = tmp_path / "tools.yaml"
    p.write_text(
        "tools:\n"
        "  - class_name: agentloop.tools.calculator.CalculatorTool\n"
        f"  - class_name: {__name__}.SlowTool\n    tool_schema: {schema('slow')}\n"
        f"  - class_name: {__name__}.BoomTool\n    tool_schema: {schema('boom')}\n"
        f"  - class_name: {__name__}.BigTool\n    tool_schema: {schema('big')}\n"
    )
    return str(p)


def call(name: str, **args: Any) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": args})}</tool_call>'


def say(text: str) -> list[int]:
    return TOK.encode(text) + [IM_END]


def run_loop(tool_yaml: str, script: list, response_length: int = 400, **multi_turn: Any):
    cfg = default_config()
    cfg.data.max_prompt_length = 256
    cfg.data.max_response_length = response_length
    OmegaConf.resolve(cfg)
    rollout = cfg.actor_rollout_ref.rollout
    rollout.multi_turn.tool_config_path = tool_yaml
    rollout.multi_turn.tool_timeout = 0.2
    for k, v in multi_turn.items():
        rollout.multi_turn[k] = v
    server = ScriptedServer(script, eos_token_id=IM_END)

    async def go():
        ToolAgentLoop.init_class(rollout, TOK)
        loop = ToolAgentLoop(rollout, AsyncLLMServerManager([server]), TOK)
        prompt = np.empty(1, dtype=object)
        prompt[0] = [{"role": "user", "content": "What is 2 + 3?"}]
        return await loop.run({"temperature": 1.0, "logprobs": True}, raw_prompt=prompt[0])

    return asyncio.run(go()), server


def tool_text(out) -> str:
    ids = np.array(out.response_ids)
    return TOK.decode(ids[np.array(out.response_mask) == 0].tolist())


def test_call_then_answer_exact_tokens_and_mask(tool_yaml):
    first, second = say(call("calculator", expression="2 + 3")), say("The answer is 5.")
    out, server = run_loop(tool_yaml, [first, second])
    assert out.status == "stop" and out.num_turns == 4
    assert "5" in tool_text(out) and "tool" in tool_text(out)
    # the second request continues exactly from prompt + sampled ids + tool turn
    sent = server.calls[1]["prompt_ids"]
    assert sent == out.prompt_ids + out.response_ids[: len(sent) - len(out.prompt_ids)]
    assert out.response_ids[: len(first)] == first and out.response_ids[-len(second):] == second
    mask = np.array(out.response_mask)
    assert mask[: len(first)].all() and mask[-len(second):].all() and (mask == 0).sum() > 0
    assert np.array(out.response_logprobs)[mask == 0].sum() == 0
    assert out.extra_fields["num_tool_calls"] == 1 and out.extra_fields["num_tool_errors"] == 0


def test_calls_beyond_the_parallel_limit_get_an_error_not_silence(tool_yaml):
    two = say(call("calculator", expression="1 + 1") + call("calculator", expression="2 + 2"))
    out, _ = run_loop(tool_yaml, [two, say("done")], max_parallel_calls=1)
    assert (
        "at most 1 tool call" in tool_text(out)
        and "2\n" not in tool_text(out).split("at most")[0][-3:]
    )
    assert out.extra_fields["num_dropped_calls"] == 1


@pytest.mark.parametrize(
    ("name", "expected", "counter"),
    [("search", "available tools: ['big', 'boom', 'calculator', 'slow']", "num_tool_errors"),
     ("boom", "kaboom", "num_tool_errors"), ("slow", "timed out", "num_tool_timeouts")],
)
def test_tool_failures_become_messages(tool_yaml, name, expected, counter):
    RELEASED.clear()
    out, _ = run_loop(tool_yaml, [say(call(name)), say("ok")])
    assert expected in tool_text(out) and out.status == "stop"
    assert out.extra_fields[counter] == 1
    if name == "slow":
        assert len(RELEASED) == 1, "release must run even after a timeout"


def test_huge_tool_output_is_truncated(tool_yaml):
    out, _ = run_loop(tool_yaml, [say(call("big")), say("ok")], max_tool_response_length=20,
                      tool_response_truncate_side="left")
    assert "x" * 20 + "...(truncated)" in tool_text(out) and "x" * 21 not in tool_text(out)
    assert out.extra_fields["tool_rewards"] == [1.0]


def test_malformed_call_is_reported_and_the_loop_continues(tool_yaml):
    out, _ = run_loop(tool_yaml, [say("<tool_call>{oops</tool_call>"), say("sorry")])
    assert "could not parse" in tool_text(out) and out.status == "stop"
    assert out.extra_fields["num_parse_errors"] == 1


def test_budget_exhausted_mid_tool_stops_with_length(tool_yaml):
    first = say(call("calculator", expression="2 + 3"))
    out, server = run_loop(tool_yaml, [first], response_length=len(first) + 10)
    assert out.status == "length" and out.response_ids == first and len(server.calls) == 1


def test_assistant_turn_limit(tool_yaml):
    out, server = run_loop(
        tool_yaml, [say(call("calculator", expression="1"))] * 3, max_assistant_turns=1
    )
    assert out.status == "max_turns" and len(server.calls) == 1


def test_generation_asks_only_for_the_remaining_budget(tool_yaml):
    out, server = run_loop(
        tool_yaml, [say(call("calculator", expression="1")), say("ok")], response_length=300
    )
    first_budget = server.calls[0]["sampling_params"]["max_tokens"]
    second_budget = server.calls[1]["sampling_params"]["max_tokens"]
    assert first_budget == 300 and second_budget == 300 - (
        len(server.calls[1]["prompt_ids"]) - len(out.prompt_ids)
    )


def run_with_interaction(
    tmp_path, tool_yaml, script, truth="5", max_attempts=2, max_user_turns=None, name="grader",
    configured=True, reward_function=None,
):
    inter = tmp_path / "interactions.yaml"
    inter.write_text("interaction:\n  - name: grader\n"
                     "    class_name: agentloop.interactions.answer_check.AnswerCheckInteraction\n"
                     f"    config: {{max_attempts: {max_attempts}}}\n")
    cfg = default_config()
    cfg.data.max_prompt_length = 256
    cfg.data.max_response_length = 400
    OmegaConf.resolve(cfg)
    rollout = cfg.actor_rollout_ref.rollout
    rollout.multi_turn.tool_config_path = tool_yaml
    rollout.multi_turn.interaction_config_path = str(inter) if configured else None
    rollout.multi_turn.max_user_turns = max_user_turns
    cfg.custom_reward_function.path = reward_function
    server = ScriptedServer(script, eos_token_id=IM_END)

    async def go():
        ToolAgentLoop.init_class(cfg, TOK)
        loop = ToolAgentLoop(cfg, AsyncLLMServerManager([server]), TOK)
        extra = {"interaction_kwargs": {"name": name, "ground_truth": truth}}
        return await loop.run(
            {}, raw_prompt=[{"role": "user", "content": "2 + 3?"}], extra_info=extra
        )

    return asyncio.run(go()), server


def test_interaction_asks_again_then_scores(tmp_path, tool_yaml):
    out, server = run_with_interaction(
        tmp_path, tool_yaml, [say("The answer is 6."), say("The answer is 5.")]
    )
    assert out.status == "stop" and out.reward_score == 1.0
    assert out.extra_fields["turn_scores"] == [0.0, 1.0]
    assert "not right" in tool_text(out) and len(server.calls) == 2
    assert out.num_turns == 4  # prompt + 2 assistant + 1 user reply


def test_interaction_score_leaves_the_reward_to_a_configured_function_as_in_verl(
    tmp_path, tool_yaml
):
    """verl's tool_agent never sets reward_score, so verl's worker scores it with
    custom_reward_function; with a function configured ours does the same (the interaction's score
    is kept beside it), else it is the reward."""
    out, _ = run_with_interaction(
        tmp_path, tool_yaml, [say("The answer is 6."), say("The answer is 5.")],
        reward_function="agentloop.rewards.calculator",
    )
    assert out.reward_score is None and out.extra_fields["interaction_score"] == 1.0
    assert out.extra_fields["turn_scores"] == [0.0, 1.0]


def test_interaction_gives_up_after_max_attempts(tmp_path, tool_yaml):
    out, _ = run_with_interaction(
        tmp_path, tool_yaml, [say("The answer is 1.")] * 3, max_attempts=2
    )
    assert out.reward_score == 0.0 and out.extra_fields["turn_scores"] == [0.0, 0.0]


def test_interaction_with_tool_calls_and_user_turn_limit(tmp_path, tool_yaml):
    script = [
        say(call("calculator", expression="2 + 3")), say("The answer is 4."),
        say("The answer is 5."),
    ]
    out, server = run_with_interaction(tmp_path, tool_yaml, script, max_user_turns=2)
    # tool turn + grader reply = 2 user turns
    assert out.status == "max_turns" and len(server.calls) == 2


def test_unknown_interaction_name_is_an_error(tmp_path, tool_yaml):
    from agentloop.errors import ConfigError

    with pytest.raises(ConfigError, match="nobody"):
        run_with_interaction(tmp_path, tool_yaml, [say("The answer is 5.")], name="nobody")


def test_interaction_kwargs_without_interaction_config_are_ignored_as_in_verl(tmp_path, tool_yaml):
    """verl's GSM8K tool-agent data carries interaction_kwargs; verl starts an interaction only when
    multi_turn.interaction_config_path is set, so such a sample runs as a plain tool-agent rollout.
    """
    out, server = run_with_interaction(
        tmp_path, tool_yaml, [say("The answer is 5.")], configured=False
    )
    assert out.status == "stop" and out.reward_score is None and len(server.calls) == 1
    assert out.extra_fields["turn_scores"] == []