"""All three context-edit sources on the real vLLM CPU engine return several exact trajectories per
sample.

One manager (1 server, 2 workers, tiny model, fp32) per source.  Each sample is a word problem plus
two follow-up problems (``examples/context_window``'s interaction), rolled out greedily:

* ``window``: ``multi_turn.context_window: 1`` pushes the first calculator result out of the window
  when the first follow-up arrives;
* ``tool``: the calculator is ``examples.context_window.forgetful.ForgetfulCalculatorTool``, which
  on a follow-up replaces the earlier turns by a summary (a tool's context edit);
* ``template``: a chat template that renders an earlier final answer shorter once a later user turn
  exists (as Qwen3 drops earlier ``<think>`` blocks), so the conversation is not prefix-stable at
  the follow-up.

Each time ``tool_agent`` closes a snapshot.  Every row must be a full chat-template render of its
own conversation, token for token, with the engine's log-probs on exactly the sampled tokens.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.integration

PROBLEMS, QUESTIONS = 4, 3


@pytest.fixture(scope="module")
def model_path() -> str:
    from agentloop.testing.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model())


def answer_dropping_template(template: str) -> str:
    """``template``, but a plain assistant answer before the last user message keeps only what
    follows its last ``" is "`` ("The answer is 6." -> "6."): not prefix-stable once a follow-up
    question arrives."""
    head = (
        "{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}{%- if m.role "
        "== 'user' %}"
        "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    )
    plain = "    {%- elif message.role is defined and message.role %}"
    assert plain in template
    drop = (
        "    {%- elif message.role == 'assistant' and loop.index0 < ns.last_user %}\n"
        "        {{- '<|im_start|>assistant\\n' ~ (message.content or '').split(' is "
        "')[-1] ~ '<|im_end|>\\n' }}\n"
    )
    return head + template.replace(plain, drop + plain)


@pytest.fixture(scope="module", params=["window", "tool", "template"])
def source(request) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def tokenizer(model_path, source):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    if source == "template":
        tok.chat_template = answer_dropping_template(tok.chat_template)
    return tok


@pytest.fixture(scope="module")
def engine(shared_tiny_engine):
    """One vLLM engine for the three sources (conftest's, shared with test_vllm_envs): each
    source's manager routes to its servers (none started, none stopped by it), since only the agent
    loop's config differs."""
    return shared_tiny_engine


@pytest.fixture(scope="module")
def rollout(engine, model_path, source, tokenizer):
    from omegaconf import OmegaConf

    from agentloop.batch.data import rows_to_batch
    from agentloop.rollout.manager import AgentLoopManager
    from agentloop.routing import LLMServerClient
    from examples.context_window.run import make_rows, rollout_config

    cfg = rollout_config(model_path, window=1 if source == "window" else None, questions=QUESTIONS)
    if source == "tool":
        OmegaConf.update(cfg, "actor_rollout_ref.rollout.multi_turn.tool_config_path",
                         "examples/context_window/forgetful_tools.yaml")
    if source == "template":
        OmegaConf.update(
            cfg, "actor_rollout_ref.model.custom_chat_template", tokenizer.chat_template,
            force_add=True,
        )
    manager = AgentLoopManager(cfg, LLMServerClient(engine))
    try:
        batch = rows_to_batch(make_rows(PROBLEMS, QUESTIONS))
        batch.meta_info["validate"] = True  # greedy: the same trajectories every run
        yield manager.generate_sequences(batch)
    finally:
        manager.shutdown()


def test_each_sample_returns_several_trajectories_in_order(rollout, source):
    nt = rollout.non_tensor_batch
    index, k, t = (
        nt["index"].tolist(), nt["num_trajectories"].tolist(), nt["trajectory_index"].tolist(),
    )
    assert sorted(set(index)) == list(range(PROBLEMS))
    for sample in range(PROBLEMS):
        rows = [i for i, x in enumerate(index) if x == sample]
        assert len(rows) >= 2, f"sample {sample}: the window should have slid at least once"
        assert [t[i] for i in rows] == list(range(len(rows))) and {k[i] for i in rows} == {
            len(rows)
        }
        assert (
            len({nt["uid"][i] for i in rows}) == 1 and len({nt["session_id"][i] for i in rows}) == 1
        )
        assert [nt["context_edit"][i] for i in rows] == [source] * (len(rows) - 1) + [None]
        assert {nt["num_context_edits"][i] for i in rows} == {len(rows) - 1}


def test_every_trajectory_is_a_full_render_of_its_own_context(rollout, source, tokenizer):
    from agentloop.loops.context import PLACEHOLDER
    from agentloop.loops.prompt import apply_chat_template
    from agentloop.tokenization.incremental import turn_separator
    from agentloop.tools.calculator import CALCULATOR_TOOL_DICT
    from agentloop.tools.context_tools import SUMMARY_PREFIX

    tok = tokenizer
    sep = tok.encode(turn_separator(tok), add_special_tokens=False)
    b, nt = rollout.batch, rollout.non_tensor_batch
    prompt_len, tools, checked = b["prompts"].shape[1], [CALCULATOR_TOOL_DICT], 0
    for i, messages in enumerate(nt["messages"].tolist()):
        messages = list(messages)
        ids = b["input_ids"][i][b["attention_mask"][i].bool()].tolist()
        assert messages[-1]["role"] == "assistant"
        # the prompt renders every message before the trajectory's first sampled turn (one per 0 ->
        # 1 step)
        mask = b["response_mask"][i].tolist()
        sampled = sum(1 for j, m in enumerate(mask) if m and (j == 0 or not mask[j - 1]))
        first = [j for j, m in enumerate(messages) if m["role"] == "assistant"][-sampled]
        prompt = b["prompts"][i][b["attention_mask"][i, :prompt_len].bool()].tolist()
        assert prompt == apply_chat_template(
            tok, messages[:first], tools=tools, add_generation_prompt=True
        )
        # the whole row renders its conversation, unless the policy sampled a malformed tool call
        # (its parsed
        # message cannot re-render the sampled text; the sampled ids are kept as they are)
        if nt["num_parse_errors"][i] == 0:
            assert ids + sep == apply_chat_template(tok, messages, tools=tools), f"row {i}"
            checked += 1
        # it starts from the edited conversation
        if nt["trajectory_index"][i] > 0 and source == "window":
            assert any(m["role"] == "tool" and m["content"] == PLACEHOLDER for m in messages)
        if nt["trajectory_index"][i] > 0 and source == "tool":
            assert any(str(m.get("content", "")).startswith(SUMMARY_PREFIX) for m in messages)
        # log-probs: finite and <= 0 on the sampled tokens, 0 elsewhere
        bits, lp = b["response_mask"][i].bool(), b["rollout_log_probs"][i]
        assert (
            bits.any()
            and torch.isfinite(lp).all()
            and (lp[bits] <= 0).all()
            and (lp[~bits] == 0).all()
        )
        assert (lp[bits] < 0).any()
        # the response starts with a sampled token: an edited context goes into the prompt, not the
        # response
        assert bool(bits[0]) and int(b["attention_mask"][i, prompt_len]) == 1
    assert checked >= PROBLEMS
