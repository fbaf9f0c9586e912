"""A reasoning model through the gateway on a real engine (vLLM CPU): docs/gateway.md#reasoning.

The model is the tiny model with a Qwen3-thinking-style template (``agentloop.testing.reasoning``):
its generation prompt opens ``<think>``, so with ``gateway.reasoning_parser: deepseek_r1`` what the
engine samples up to ``</think>`` is reasoning.  The tiny model never learnt ``</think>``, so every
reply is reasoning only (content ""): honest, and enough to check that reasoning comes back as
``reasoning_content`` (plain and streamed), that the client can echo it, and that the trajectories
hold exactly what the engine sampled and was fed.  Its own module: the shared manager of
test_gateway_clients.py serves the tiny model's plain template.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from agentloop.batch.data import rows_to_batch
from agentloop.config import default_config

pytestmark = pytest.mark.integration

PROMPT_LEN, RESPONSE_LEN = 512, 96
AGAIN = {"role": "user", "content": "Check it once more."}


async def reasoning_chat(*, base_url: str, api_key: str, raw_prompt: list[dict[str, Any]],
                         extra_info: dict[str, Any], **_: Any) -> None:
    """Two chat turns with the openai SDK (plain, then streamed), echoing the first reply with its
    reasoning; what the client received goes to the ``report`` file."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    first = await client.chat.completions.create(model="policy", messages=raw_prompt, max_tokens=32)
    echo = first.choices[0].message.model_dump(exclude_none=True)
    turns = [{"reasoning": (first.choices[0].message.model_extra or {}).get("reasoning_content"),
              "content": first.choices[0].message.content, "echo": echo}]
    reasoning, content = "", ""
    stream = await client.chat.completions.create(
        model="policy", messages=[*raw_prompt, echo, AGAIN], max_tokens=32, stream=True)
    async for chunk in stream:
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    turns.append({"reasoning": reasoning, "content": content})
    Path(extra_info["report"]).write_text(json.dumps(turns))


@pytest.fixture(scope="module")
def manager():
    import ray
    import ray.cloudpickle

    from agentloop.gateway.framework import register_agent_runner
    from agentloop.loops.base import _agent_loop_registry
    from agentloop.rollout.manager import AgentLoopManager
    from agentloop.testing.reasoning import REASONING_PARSER, ensure_tiny_reasoning_model

    register_agent_runner("reasoning_chat")(reasoning_chat)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=3, include_dashboard=False, logging_level="ERROR")
    cfg = default_config()
    for k, v in {
        "actor_rollout_ref.model.path": str(ensure_tiny_reasoning_model()),
        "data.max_prompt_length": PROMPT_LEN, "data.max_response_length": RESPONSE_LEN,
        "actor_rollout_ref.rollout.dtype": "float32",
        "actor_rollout_ref.rollout.calculate_log_probs": True,
        "actor_rollout_ref.rollout.free_cache_engine": False,
        # eager: ~10 s less per CPU engine start (compiled, the default: test_vllm_envs CLI test)
        "actor_rollout_ref.rollout.enforce_eager": True,
        "actor_rollout_ref.rollout.max_num_seqs": 8,
        "actor_rollout_ref.rollout.agent.num_workers": 1,
        "actor_rollout_ref.rollout.server.num_servers": 1,
        "actor_rollout_ref.rollout.server.device": "cpu",
        "actor_rollout_ref.rollout.multi_turn.format": "hermes",
        "actor_rollout_ref.rollout.gateway.reasoning_parser": REASONING_PARSER,
    }.items():
        OmegaConf.update(cfg, k, v)
    m = AgentLoopManager(cfg)
    yield m
    m.shutdown()
    ray.shutdown()
    _agent_loop_registry.pop("reasoning_chat", None)


def row_ids(out: Any, row: int) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, response ids, response mask) of one output row, padding removed."""
    attn = out.batch["attention_mask"][row].bool()
    prompt = out.batch["input_ids"][row][attn][: int(attn[:PROMPT_LEN].sum())].tolist()
    keep = attn[PROMPT_LEN:]
    response = out.batch["responses"][row][keep].tolist()
    mask = out.batch["response_mask"][row][keep].tolist()
    return prompt, response, mask


def test_reasoning_is_returned_echoed_and_recorded_token_exact(manager, tmp_path):
    """Turn 1 (plain) and turn 2 (streamed, after the echoed turn 1 and a new question) come back as
    reasoning_content; the new question makes the template drop turn 1's reasoning, so turn 2 starts
    a new trajectory (a snapshot) whose prompt is the full render; each trajectory's sampled ids are
    what the client received."""
    from agentloop.testing.tiny_corpus import SYSTEM_PROMPTS

    prompt = [{"role": "system", "content": SYSTEM_PROMPTS[1]},
              {"role": "user", "content": "Ann has 3 apples and buys 4 more. How many apples now?"}]
    report = tmp_path / "reasoning.json"
    batch = rows_to_batch([{"prompt": prompt, "agent_name": "reasoning_chat",
                            "extra_info": {"index": 0, "report": str(report)}}])
    batch.meta_info["validate"] = True  # greedy
    out = manager.generate_sequences(batch)
    nt = out.non_tensor_batch
    assert len(nt["status"]) == 2, nt.get("error")  # the snapshot and the final trajectory
    first, second = json.loads(report.read_text())
    assert first["reasoning"] and second["reasoning"]  # the tiny model's whole reply is reasoning
    assert first["content"] == "" and second["content"] == ""
    tok = manager.tokenizer
    for row, turn in enumerate((first, second)):
        prompt_ids, response, mask = row_ids(out, row)
        assert all(mask) and response  # one sampled turn per trajectory, nothing else
        assert tok.decode(response, skip_special_tokens=True).strip() == turn["reasoning"]
    conversation = [*prompt, first["echo"], AGAIN]
    rendered = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert row_ids(out, 1)[0] == tok.encode(rendered, add_special_tokens=False)
    first_prompt = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert row_ids(out, 0)[0] == tok.encode(first_prompt, add_special_tokens=False)
