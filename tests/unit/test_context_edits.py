"""Snapshots in tool_agent: a context edit closes the trajectory and starts a new one (fake engine,
tiny tokenizer).

For each source (a tool's edit, the sliding window, a chat template that is not prefix-stable) the
rollout must return trajectories whose prompt + response equal a full chat-template render of their
own conversation (mask 0: template tokens, mask 1: exactly the sampled ids, with their log-probs).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from omegaconf import OmegaConf

from agentloop.config import default_config
from agentloop.errors import ConfigError
from agentloop.loops.context import PLACEHOLDER, ContextSettings
from agentloop.loops.prompt import apply_chat_template
from agentloop.loops.tool_agent import ToolAgentLoop
from agentloop.routing import AsyncLLMServerManager
from agentloop.testing import ScriptedServer
from agentloop.testing.scripted import fake_log_probs
from agentloop.tokenization.incremental import turn_separator
from agentloop.tools import BaseTool, ToolResponse
from agentloop.tools.context_tools import (
    ContextEdit,
    current_messages,
    request_context_edit,
    tool_turn,
)
from agentloop.types import MultiTrajectoryAgentLoopOutput


class RewardTool(BaseTool):
    """``score()`` answers "ok" with step reward 1.0."""

    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="ok"), 1.0, {}


def short_summary(messages: list[dict[str, Any]]) -> str:
    return f"{len(messages)} messages about arithmetic"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from agentloop.testing.tiny_model import ensure_tiny_model

    return AutoTokenizer.from_pretrained(str(ensure_tiny_model()))


@pytest.fixture
def tool_yaml(tmp_path):
    p = tmp_path / "tools.yaml"
    p.write_text(
        "tools:\n"
        "  - class_name: agentloop.tools.calculator.CalculatorTool\n"
        "  - class_name: agentloop.tools.context_tools.DeleteContextTool\n"
        "  - class_name: agentloop.tools.context_tools.SummarizeContextTool\n"
        f"  - class_name: {__name__}.RewardTool\n"
        "    tool_schema: {type: function, function: {name: score, description: d}}\n"
    )
    return str(p)


def sample(tok, name: str, **args: Any) -> list[int]:
    """The ids the policy samples for one tool call, as the chat template renders it, + EOS."""
    text = f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


def say(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


def rollout(
    tok, tool_yaml: str, script: list, *, interaction: str | None = None, prompt_length: int = 1024,
    chat_template: str | None = None, **multi_turn: Any,
):
    cfg = default_config()
    cfg.data.max_prompt_length = prompt_length
    cfg.data.max_response_length = 512
    OmegaConf.resolve(cfg)
    rollout_cfg = cfg.actor_rollout_ref.rollout
    rollout_cfg.multi_turn.tool_config_path = tool_yaml
    rollout_cfg.multi_turn.max_parallel_calls = 2
    rollout_cfg.multi_turn.return_messages = True
    rollout_cfg.multi_turn.interaction_config_path = interaction
    for k, v in multi_turn.items():
        rollout_cfg.multi_turn[k] = v
    server = ScriptedServer(script, eos_token_id=tok.eos_token_id)
    if chat_template is not None:
        tok = _with_template(tok, chat_template)

    async def go():
        ToolAgentLoop.init_class(rollout_cfg, tok)
        loop = ToolAgentLoop(rollout_cfg, AsyncLLMServerManager([server]), tok)
        extra = (
            {"interaction_kwargs": {"name": "grader", "ground_truth": "5"}} if interaction else None
        )
        return await loop.run(
            {"logprobs": True}, raw_prompt=[{"role": "user", "content": "What is 2 + 3?"}],
            extra_info=extra,
        )

    out = asyncio.run(go())
    rows = out.trajectories if isinstance(out, MultiTrajectoryAgentLoopOutput) else [out]
    return rows, server, tok


def _with_template(tok, template: str):
    import copy

    clone = copy.copy(tok)
    clone.chat_template = template
    return clone


def assert_exact(rows, tok, server, script) -> None:
    """Every row = a full render of its own messages; mask 1 = sampled ids (with their
    log-probs), in order."""
    tools = ToolAgentLoop.tool_schemas
    sep = tok.encode(turn_separator(tok), add_special_tokens=False)
    replies = iter(range(len(server.calls)))
    for row in rows:
        messages = row.extra_fields["messages"]
        assert messages[-1]["role"] == "assistant"
        assert row.prompt_ids + row.response_ids + sep == apply_chat_template(
            tok, messages, tools=tools
        )
        assert row.prompt_ids == apply_chat_template(
            tok, messages[: _prompt_end(messages, row)], tools=tools, add_generation_prompt=True
        )
        # the sampled runs, in order, are exactly the server's replies, with the replies' log-probs
        runs, run = [], []
        for i, m in enumerate(row.response_mask):
            if m:
                run.append(i)
            elif run:
                runs.append(run)
                run = []
        runs += [run] if run else []
        for run in runs:
            k = next(replies)
            call, got = server.calls[k], [row.response_ids[i] for i in run]
            assert got == script[k]
            assert call["prompt_ids"] == row.prompt_ids + row.response_ids[:run[0]]
            assert [row.response_logprobs[i] for i in run] == fake_log_probs(len(got))
        assert all(
            lp == 0.0
            for lp, m in zip(row.response_logprobs, row.response_mask, strict=True)
            if not m
        )
    assert next(replies, None) is None, "every generation belongs to exactly one trajectory"


def _prompt_end(messages: list[dict[str, Any]], row) -> int:
    """Messages in the row's prompt: all before its first sampled assistant turn (one per
    generation)."""
    sampled = sum(
        1 for i, m in enumerate(row.response_mask) if m and (i == 0 or not row.response_mask[i - 1])
    )
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return assistants[len(assistants) - sampled]


def fields(rows, key: str) -> list:
    return [r.extra_fields[key] for r in rows]


# --- (a) a tool's edit
# ------------------------------------------------------------------------------------


def test_delete_context_closes_a_snapshot_and_the_next_prompt_renders_the_edited_conversation(
    tok, tool_yaml
):
    script = [
        sample(tok, "score"), sample(tok, "delete_context", first=1, last=2),
        say(tok, "The answer is 5."),
    ]
    rows, server, tok = rollout(tok, tool_yaml, script)
    assert len(rows) == 2
    first, final = rows
    # the snapshot ends with the delete call (sampled); its tool result opens the next prompt
    n = len(script[1])
    assert first.response_ids[-n:] == script[1] and first.response_mask[-n:] == [1] * n
    assert [m["role"] for m in final.extra_fields["messages"]] == [
        "user", "assistant", "tool", "assistant",
    ]
    assert "delete_context" in json.dumps(final.extra_fields["messages"][1]["tool_calls"])
    assert final.extra_fields["messages"][2]["content"] == "Deleted messages 1-2 (2 messages)."
    assert final.response_ids == script[2] and final.response_mask == [1] * len(script[2])
    assert_exact(rows, tok, server, script)
    # tool rewards stay on the trajectory whose call earned them; every row knows the episode's edit
    # count
    assert fields(rows, "tool_rewards") == [[1.0, 0.0], []]
    assert fields(rows, "num_tool_calls") == [2, 0]
    assert fields(rows, "context_edit") == ["tool", None] and fields(rows, "num_context_edits") == [
        1,
        1,
    ]
    assert [r.num_turns for r in rows] == [4, 2] and [r.status for r in rows] == ["stop", "stop"]


def test_summarize_context_with_the_models_summary_and_with_a_summarizer(tok, tool_yaml, tmp_path):
    script = [
        sample(tok, "score"),
        sample(tok, "summarize_context", first=0, last=2, summary="asked 2 + 3"),
        say(tok, "The answer is 5."),
    ]
    rows, server, tok = rollout(tok, tool_yaml, script)
    summary = rows[-1].extra_fields["messages"][0]
    assert summary == {"role": "user", "content": "Summary of earlier messages: asked 2 + 3"}
    assert_exact(rows, tok, server, script)

    own = tmp_path / "tools2.yaml"
    own.write_text(
        "tools:\n  - class_name: agentloop.tools.context_tools.SummarizeContextTool\n"
        f"    config: {{summarizer: '{__name__}:short_summary', summary_role: "
        f"system}}\n"
    )
    script = [sample(tok, "summarize_context", first=0, last=0), say(tok, "The answer is 5.")]
    rows, server, tok = rollout(tok, str(own), script)
    expected = {
        "role": "system",
        "content": "Summary of earlier messages: 1 messages about arithmetic",
    }
    assert rows[-1].extra_fields["messages"][0] == expected
    assert_exact(rows, tok, server, script)


def test_an_invalid_edit_is_a_tool_error_and_no_snapshot(tok, tool_yaml):
    # message 1 is the calling turn itself: it cannot be deleted
    script = [sample(tok, "delete_context", first=0, last=1), say(tok, "The answer is 5.")]
    rows, _, _ = rollout(tok, tool_yaml, script)
    assert len(rows) == 1 and rows[0].extra_fields["num_tool_errors"] == 1
    assert "cannot be edited" in rows[0].extra_fields["messages"][2]["content"]
    assert (
        rows[0].extra_fields["num_context_edits"] == 0
        and rows[0].extra_fields["context_edit"] is None
    )


def test_the_edit_api_outside_and_inside_a_tool_turn():
    with pytest.raises(RuntimeError, match="only inside a tool call"):
        current_messages()
    with pytest.raises(ValueError, match="0 <= start < stop"):
        ContextEdit.delete(3, 3)
    with tool_turn(
        [
            {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "call"},
        ]
    ) as turn:
        request_context_edit(ContextEdit.delete(0, 2))
        with pytest.raises(ValueError, match="overlap"):
            request_context_edit(ContextEdit.delete(1, 3))
        with pytest.raises(ValueError, match="cannot be edited"):
            request_context_edit(ContextEdit.delete(2, 4))
    assert turn.edits == [ContextEdit(0, 2)]


# --- (b) the sliding window
# --------------------------------------------------------------------------------


@pytest.mark.parametrize(("window", "expected"), [(1, 3), (2, 2), (3, 1)])
def test_sliding_window_snapshots_each_time_a_tool_result_leaves_it(
    tok, tool_yaml, window, expected
):
    script = [sample(tok, "calculator", expression=e) for e in ("2 + 3", "4 + 5", "6 + 7")] + \
        [say(tok, "The answer is 13.")]
    rows, server, tok = rollout(tok, tool_yaml, script, context_window=window)
    assert len(rows) == expected
    assert_exact(rows, tok, server, script)
    final = rows[-1].extra_fields["messages"]
    results = [m["content"] for m in final if m["role"] == "tool"]
    assert results == [PLACEHOLDER] * (3 - window) + ["5", "9", "13"][3 - window:]
    assert fields(rows, "context_edit") == ["window"] * (expected - 1) + [None]
    # a snapshot's boundaries: it ends with the call whose results pushed an older result out of the
    # window
    for j, row in enumerate(rows[:-1]):
        assert row.response_ids[-len(script[window + j]):] == script[window + j]
    if expected > 1:
        assert rows[-1].response_ids == script[-1]  # the final trajectory sampled only the answer


def test_max_context_edits_ends_the_episode_at_the_edit_beyond_it(tok, tool_yaml):
    script = [sample(tok, "calculator", expression=e) for e in ("2 + 3", "4 + 5", "6 + 7")] + \
        [say(tok, "The answer is 13.")]
    rows, server, tok = rollout(tok, tool_yaml, script, context_window=1, max_context_edits=1)
    assert len(rows) == 2 and len(server.calls) == 3
    assert [r.status for r in rows] == ["stop", "max_turns"]
    assert fields(rows, "context_edits_capped") == [True, True]
    assert_exact(rows, tok, server, script)


def test_no_empty_trajectory_when_the_user_turn_cap_is_reached_at_an_edit(tok, tool_yaml):
    script = [sample(tok, "calculator", expression=e) for e in ("2 + 3", "4 + 5", "6 + 7")]
    rows, server, tok = rollout(tok, tool_yaml, script, context_window=1, max_user_turns=2)
    assert len(rows) == 1 and rows[0].status == "max_turns" and len(server.calls) == 2
    assert rows[0].response_ids[-len(script[1]):] == script[1]


def test_a_new_prompt_longer_than_prompt_length_ends_the_episode_untruncated(tok, tool_yaml):
    script = [sample(tok, "calculator", expression=e) for e in ("2 + 3", "4 + 5")] + [
        say(tok, "The answer is 9.")
    ]
    full, _, _ = rollout(tok, tool_yaml, script, context_window=1)
    too_small = len(full[-1].prompt_ids) - 1
    rows, server, _ = rollout(tok, tool_yaml, script, context_window=1, prompt_length=too_small)
    assert len(rows) == 1 and rows[0].status == "length" and len(server.calls) == 2


@pytest.mark.parametrize(("key", "value"), [("context_window", 0), ("context_window", "2"),
                                            ("max_context_edits", -1)])
def test_bad_settings_say_what_to_give(key, value):
    with pytest.raises(ConfigError, match=f"multi_turn.{key}"):
        ContextSettings.from_config(OmegaConf.create({key: value}))


# --- (c) a chat template that is not prefix-stable
# ----------------------------------------------------------


def qwen3_like_template(tok) -> str:
    """The tiny template, but an assistant turn's ``<think>`` block is dropped once a later user
    turn exists."""
    head = (
        "{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}{%- if m.role == "
        "'user' %}"
        "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    )
    plain = "    {%- elif message.role is defined and message.role %}"
    assert plain in tok.chat_template
    drop = (
        "    {%- elif message.role == 'assistant' and '</think>' in (message.content or '') "
        "and loop.index0 < ns.last_user %}\n"
        "        {{- '<|im_start|>assistant\\n' ~ message.content.split('</think>')[-1] "
        "~ '<|im_end|>\\n' }}\n"
    )
    return head + tok.chat_template.replace(plain, drop + plain)


def test_a_template_that_rerenders_the_previous_turn_snapshots_instead_of_failing(
    tok, tool_yaml, tmp_path
):
    inter = tmp_path / "interactions.yaml"
    inter.write_text("interaction:\n  - name: grader\n"
                     "    class_name: agentloop.interactions.answer_check.AnswerCheckInteraction\n")
    script = [
        say(tok, "<think>add</think>The answer is 6."),
        say(tok, "<think>again</think>The answer is 5."),
    ]
    # prefix-stable template: one trajectory
    rows, server, plain = rollout(tok, tool_yaml, script, interaction=str(inter))
    assert len(rows) == 1 and rows[0].reward_score == 1.0
    assert_exact(rows, plain, server, script)
    # Qwen3-like template: the user's reply drops the earlier <think> block -> snapshot, both rows
    # exact
    rows, server, qwen3 = rollout(tok, tool_yaml, script, interaction=str(inter),
                                  chat_template=qwen3_like_template(tok))
    assert len(rows) == 2 and fields(rows, "context_edit") == ["template", None]
    assert rows[1].extra_fields["messages"][1]["content"] == "<think>add</think>The answer is 6."
    assert "<think>add" not in qwen3.decode(rows[1].prompt_ids) and "<think>add" in qwen3.decode(
        rows[0].response_ids
    )
    assert_exact(rows, qwen3, server, script)
    # the interaction's episode score is on the final trajectory; turn scores on the turn that
    # earned them
    assert [r.reward_score for r in rows] == [None, 1.0]
    assert fields(rows, "turn_scores") == [[0.0], [1.0]]
