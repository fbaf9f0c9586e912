"""The full path on a real engine: manager → workers → global balancer → 2 vLLM CPU servers.

One manager (2 servers, 2 workers, tiny model, fp32) is shared by the module.
"""

from __future__ import annotations

import os
import sys
from typing import Any
from uuid import uuid4

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from agentloop.batch.data import rows_to_batch
from agentloop.config import default_config
from agentloop.gateway.framework import register_agent_runner
from agentloop.loops.base import AgentLoopBase, register
from agentloop.types import AgentLoopOutput

pytestmark = pytest.mark.integration

PROMPT_LEN, RESPONSE_LEN = 256, 96


class ThreeTurnProbe(AgentLoopBase):
    """Generates three turns under one request id and records which server served each."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        request_id = uuid4().hex
        ids = [
            int(t)
            for t in self.tokenizer.apply_chat_template(
                list(kwargs["raw_prompt"]), add_generation_prompt=True, tokenize=True,
                return_dict=False,
            )
        ]
        prompt_len, mask, servers = len(ids), [], []
        for _ in range(3):
            out = await self.server_manager.generate(
                request_id=request_id, prompt_ids=ids,
                sampling_params={**sampling_params, "max_tokens": 4},
            )
            servers.append(out.extra_fields["server_index"])
            ids = ids + out.token_ids
            mask += [1] * len(out.token_ids)
        return AgentLoopOutput(
            prompt_ids=ids[:prompt_len], response_ids=ids[prompt_len:], response_mask=mask,
            num_turns=4, extra_fields={"servers": servers},
        )


@pytest.fixture(scope="module")
def model_path() -> str:
    from agentloop.testing.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model())


@pytest.fixture(scope="module")
def manager(model_path):
    import ray
    import ray.cloudpickle

    from agentloop.loops.base import _agent_loop_registry
    from agentloop.rollout.manager import AgentLoopManager

    # Registered only while this module's manager lives: at import time (pytest collects every
    # module
    # first) they would reach the workers of other modules' managers, which cannot import this
    # module.
    register("three_turn_probe")(ThreeTurnProbe)
    register_agent_runner("it_sdk_calculator")(it_sdk_calculator)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    cfg = default_config()
    for k, v in {
        "actor_rollout_ref.model.path": model_path, "data.max_prompt_length": PROMPT_LEN,
        "data.max_response_length": RESPONSE_LEN, "actor_rollout_ref.rollout.dtype": "float32",
        "actor_rollout_ref.rollout.calculate_log_probs": True,
        "actor_rollout_ref.rollout.free_cache_engine": False,
        # eager: ~10 s less per CPU engine start (compiled, the default: test_vllm_envs CLI test)
        "actor_rollout_ref.rollout.enforce_eager": True,
        "actor_rollout_ref.rollout.max_num_seqs": 32,
        "actor_rollout_ref.rollout.agent.num_workers": 2,
        "actor_rollout_ref.rollout.server.num_servers": 2,
        "actor_rollout_ref.rollout.server.device": "cpu",
        "actor_rollout_ref.rollout.multi_turn.tool_config_path": "examples/calculator_agent/tools.yaml",  # noqa: E501
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 3,
        "actor_rollout_ref.rollout.multi_turn.return_messages": True,
    }.items():
        OmegaConf.update(cfg, k, v)
    m = AgentLoopManager(cfg)
    yield m
    m.shutdown()
    ray.shutdown()
    for name in ("three_turn_probe", "it_sdk_calculator"):
        _agent_loop_registry.pop(name, None)


def make_batch(n_prompts: int, n: int, agent_name: str | None = None):
    rows = []
    for i in range(n_prompts):
        row: dict[str, Any] = {
            "prompt": [{"role": "user", "content": f"Say something about item {i}."}],
            "extra_info": {"index": i},
        }
        if agent_name:
            row["agent_name"] = agent_name
        rows.append(row)
    return rows_to_batch(rows, n=n)


def test_sixteen_samples_layout_and_logprobs(manager):
    out = manager.generate_sequences(make_batch(8, n=2))
    b, nt = out.batch, out.non_tensor_batch
    assert len(out) == 16
    assert b["prompts"].shape == (16, PROMPT_LEN) and b["responses"].shape == (16, RESPONSE_LEN)
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], dim=1))
    attn = b["attention_mask"]
    p_attn, r_attn = attn[:, :PROMPT_LEN], attn[:, PROMPT_LEN:]
    # prompts left-padded (mask is 0...0 1...1), responses right-padded (1...1 0...0)
    assert torch.all(p_attn[:, 1:] >= p_attn[:, :-1]) and torch.all(r_attn[:, 1:] <= r_attn[:, :-1])
    assert torch.all(r_attn.sum(-1) > 0)
    assert torch.equal(b["position_ids"], torch.clamp(attn.cumsum(-1) - 1, min=0))
    assert torch.equal(b["response_mask"], r_attn)  # single-turn: every response token was sampled
    lp = b["rollout_log_probs"]
    assert (
        torch.isfinite(lp).all()
        and torch.all(lp[r_attn.bool()] <= 0)
        and torch.all(lp[~r_attn.bool()] == 0)
    )
    assert set(nt["status"]) <= {"stop", "length"}
    assert list(nt["__num_turns__"]) == [2] * 16
    assert list(nt["index"]) == [i for i in range(8) for _ in range(2)]
    timing = out.meta_info["timing"]
    assert (
        timing["agent_loop/generate_sequences/max"]
        >= timing["agent_loop/generate_sequences/min"]
        > 0
    )


def test_every_turn_of_a_request_stays_on_one_server(manager):
    out = manager.generate_sequences(make_batch(16, n=1, agent_name="three_turn_probe"))
    servers = out.non_tensor_batch["servers"]
    assert all(len(set(s)) == 1 for s in servers), servers
    assert {s[0] for s in servers} == {0, 1}, "least-in-flight should use both servers"


def test_weight_update_changes_logprobs_as_predicted(manager, model_path):
    """Bucketed sync (buckets of ~20 kB, so fused q/k/v and gate/up layers straddle buckets) and the
    whole-dict file sync load the same weights: both match an HF fp32 recompute of the new weights
    to 1e-5, generate the same tokens, and every trajectory carries the version it was generated
    with."""
    from transformers import AutoModelForCausalLM

    from agentloop.testing.hf_check import max_logprob_gap, perturbed_weights

    original, new, hf = perturbed_weights(
        AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    )
    batch = make_batch(4, n=1)
    batch.meta_info["validate"] = True  # greedy
    try:
        assert manager.update_weights(iter(new.items()), global_steps=41, bucket_mb=0.02) == 41
        streamed = manager.generate_sequences(batch)
        assert manager.weights.update_whole(new, transport="file") == 42
        whole = manager.generate_sequences(batch)
        assert max_logprob_gap(hf, streamed) <= 1e-5 and max_logprob_gap(hf, whole) <= 1e-5
        assert torch.equal(streamed.batch["responses"], whole.batch["responses"])
        for out, version in ((streamed, 41), (whole, 42)):
            nt = out.non_tensor_batch
            assert (
                nt["min_global_steps"].tolist()
                == nt["max_global_steps"].tolist()
                == [version] * len(out)
            )
    finally:
        assert manager.update_weights(original) == 43
    restored = manager.generate_sequences(batch)
    assert set(restored.non_tensor_batch["max_global_steps"].tolist()) == {43}


def test_unknown_agent_name_fails_with_names(manager):
    from agentloop.errors import UnknownAgentError

    with pytest.raises(UnknownAgentError, match="single_turn_agent"):
        manager.generate_sequences(make_batch(2, n=1, agent_name="no_such_agent"))


def test_output_round_trips_through_disk(manager, tmp_path):
    from agentloop.batch.protocol import DataProto

    out = manager.generate_sequences(make_batch(2, n=1))
    out.save_to_disk(str(tmp_path / "o.dp"))
    back = DataProto.load_from_disk(str(tmp_path / "o.dp"))
    assert torch.equal(back.batch["input_ids"], out.batch["input_ids"])
    assert np.array_equal(back.non_tensor_batch["uid"], out.non_tensor_batch["uid"])


def test_trained_tiny_model_calls_the_calculator(manager):
    """The trained tiny model emits hermes tool calls; tool tokens are masked out, sampled ones
    are not."""
    import random

    from agentloop.testing.tiny_model import _SYSTEM_PROMPTS, word_problem

    rng = random.Random(7)
    rows = []
    for i in range(8):
        question, _, _ = word_problem(rng)
        messages = [
            {"role": "system", "content": _SYSTEM_PROMPTS[0]},
            {"role": "user", "content": question},
        ]
        rows.append({"prompt": messages, "agent_name": "tool_agent", "extra_info": {"index": i}})
    batch = rows_to_batch(rows)
    batch.meta_info["validate"] = True  # greedy
    out = manager.generate_sequences(batch)
    calls = np.array(out.non_tensor_batch["num_tool_calls"].tolist())
    assert (calls >= 1).mean() >= 0.75, calls
    tok = manager_tokenizer(manager)
    for i in np.nonzero(calls)[0]:
        resp = out.batch["responses"][i]
        mask = out.batch["response_mask"][i].bool()
        real = out.batch["attention_mask"][i, PROMPT_LEN:].bool()
        assert "<tool_response>" in tok.decode(resp[real & ~mask].tolist())
        assert "<tool_call>" in tok.decode(resp[mask].tolist())
        assert "<tool_response>" not in tok.decode(resp[mask].tolist())
    for i in range(len(out)):
        assert_matches_full_render(tok, out, i)


def assert_matches_full_render(tok: Any, out: Any, i: int) -> None:
    """The trajectory equals a full chat-template render of its conversation, with the assistant
    turns as sampled; every context (mask 0) run is the canonical encoding of its text."""
    from agentloop.tools.registry import initialize_tools_from_config

    tools = [t.tool_schema.model_dump(exclude_unset=True, exclude_none=True)
             for t in initialize_tools_from_config("examples/calculator_agent/tools.yaml")]
    attn = out.batch["attention_mask"][i].bool()
    prompt = out.batch["prompts"][i][attn[:PROMPT_LEN]].tolist()
    resp = out.batch["responses"][i][attn[PROMPT_LEN:]].tolist()
    mask = out.batch["response_mask"][i][attn[PROMPT_LEN:]].tolist()
    runs: list[tuple[int, list[int]]] = []
    for token, m in zip(resp, mask, strict=True):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(token)
        else:
            runs.append((m, [token]))
    for m, ids in runs:
        if m == 0:
            assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids
    sampled = [tok.decode(ids) for m, ids in runs if m == 1]
    messages, k = [], 0
    n_prompt = len(out.non_tensor_batch["raw_prompt"][i])
    for j, msg in enumerate(out.non_tensor_batch["messages"][i]):
        if j >= n_prompt and msg["role"] == "assistant":
            messages.append(
                {"role": "assistant", "content": sampled[k].removesuffix(tok.eos_token)}
            )
            k += 1
        else:
            messages.append(msg)
    assert k == len(sampled)
    full = tok.apply_chat_template(messages, tools=tools, tokenize=False)
    got = tok.decode(prompt + resp)
    assert full.startswith(got) and (full == got + "\n" or not got.endswith(tok.eos_token)), (
        got,
        full,
    )


def manager_tokenizer(manager):
    from agentloop.tokenization.loader import load_tokenizer

    return load_tokenizer(manager.config.model)


def test_tool_agent_runs_on_the_real_engine(manager):
    out = manager.generate_sequences(make_batch(4, n=1, agent_name="tool_agent"))
    assert len(out) == 4
    assert set(out.non_tensor_batch["status"]) <= {"stop", "length", "max_turns"}
    resp_attn = out.batch["attention_mask"][:, PROMPT_LEN:]
    # the random-weight model rarely emits a tool call; every token it sampled has mask 1
    mask = out.batch["response_mask"]
    assert torch.all(mask <= resp_attn)
    assert torch.all((mask.sum(-1) > 0) | (out.non_tensor_batch["__num_turns__"] == 0))


async def it_sdk_calculator(
    *, base_url: str, api_key: str, raw_prompt: list, **fields: Any
) -> None:
    """A plain OpenAI-SDK calculator agent; odd sample indices stream."""
    import json

    import openai

    from agentloop.tools.calculator import CALCULATOR_TOOL_DICT, evaluate

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [dict(m) for m in raw_prompt]
    stream = fields["extra_info"]["index"] % 2 == 1
    for _ in range(3):
        kwargs = {
            "model": "policy", "messages": messages, "tools": [CALCULATOR_TOOL_DICT],
            "temperature": 0,
        }
        if stream:
            content, calls, finish = "", {}, None
            async for chunk in await client.chat.completions.create(stream=True, **kwargs):
                if chunk.choices:
                    content += chunk.choices[0].delta.content or ""
                    for tc in chunk.choices[0].delta.tool_calls or []:
                        calls[tc.index] = {"id": tc.id, "type": "function", "function": {
                            "name": tc.function.name, "arguments": tc.function.arguments}}
                    finish = chunk.choices[0].finish_reason or finish
            msg: dict = {"role": "assistant", "content": content or None}
            if calls:
                msg["tool_calls"] = [calls[i] for i in sorted(calls)]
        else:
            resp = await client.chat.completions.create(**kwargs)
            finish, msg = (
                resp.choices[0].finish_reason,
                resp.choices[0].message.model_dump(exclude_none=True),
            )
        messages.append(msg)
        if finish != "tool_calls":
            return
        for call in msg["tool_calls"]:
            try:
                result = str(evaluate(json.loads(call["function"]["arguments"])["expression"]))
            except Exception as e:  # noqa: BLE001 - the model's expression may be malformed
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})


def test_gateway_agents_and_tool_agent_in_one_batch(manager):
    """OpenAI-SDK agents (through the gateway, streaming and not) and tool_agent samples in one
    batch."""
    import random

    from agentloop.testing.tiny_model import _SYSTEM_PROMPTS, word_problem

    rng = random.Random(11)
    rows = []
    problems = [word_problem(rng)[0] for _ in range(3)]
    for i in range(6):  # each problem once without and once with streaming
        messages = [
            {"role": "system", "content": _SYSTEM_PROMPTS[1]},
            {"role": "user", "content": problems[i // 2]},
        ]
        rows.append(
            {"prompt": messages, "agent_name": "it_sdk_calculator", "extra_info": {"index": i}}
        )
    for i in range(6, 8):
        messages = [
            {"role": "system", "content": _SYSTEM_PROMPTS[1]},
            {"role": "user", "content": problems[0]},
        ]
        rows.append({"prompt": messages, "agent_name": "tool_agent", "extra_info": {"index": i}})
    batch = rows_to_batch(rows)
    batch.meta_info["validate"] = True  # greedy
    out = manager.generate_sequences(batch)
    nt = out.non_tensor_batch
    names = nt["agent_name"].tolist()
    assert names.count("tool_agent") == 2 and names.count("it_sdk_calculator") >= 6
    assert set(nt["status"].tolist()) <= {"stop", "length", "max_turns"}, nt["error"]
    tok = manager_tokenizer(manager)
    gateway_rows = [i for i, n in enumerate(names) if n == "it_sdk_calculator"]
    by_index: dict[int, list[int]] = {}
    for i in gateway_rows:
        attn = out.batch["attention_mask"][i].bool()
        resp = out.batch["responses"][i][attn[PROMPT_LEN:]]
        mask = out.batch["response_mask"][i][attn[PROMPT_LEN:]].bool()
        assert int(mask.sum()) > 0
        assert "<tool_response>" not in tok.decode(resp[mask].tolist())
        by_index[int(nt["index"][i])] = resp.tolist()
    called = [
        i
        for i in gateway_rows
        if "<tool_response>" in tok.decode(out.batch["responses"][i].tolist())
    ]
    assert len(called) >= 4  # the trained model calls the calculator through the SDK
    for k in range(3):  # streaming and non-streaming recorded the same greedy trajectory
        assert by_index[2 * k] == by_index[2 * k + 1]


def test_abort_on_the_real_engine_returns_aborted(manager):
    """A running request (its first tokens have streamed back) is aborted: it ends early with
    'aborted'."""
    import ray

    server = manager.server_handles[0]
    params = {"max_tokens": RESPONSE_LEN, "ignore_eos": True, "temperature": 1.0}
    load = [server.generate.remote(prompt_ids=[5, 6, 7, 8] * 8 + [10 + i], sampling_params=params,
                                   # slows every sequence down
                                   request_id=f"load-{i}") for i in range(31)]
    stream = server.generate_stream.options(num_returns="streaming").remote(
        prompt_ids=[9, 10, 11, 12] * 8, sampling_params=params, request_id="to-abort")
    deltas = [ray.get(next(stream))]  # the request is running now
    ray.get(server.abort.remote("to-abort"))
    deltas += [ray.get(ref) for ref in stream]
    assert deltas[-1].finished and deltas[-1].stop_reason == "aborted"
    assert sum(len(d.token_ids) for d in deltas) < RESPONSE_LEN
    assert all(
        o.stop_reason == "length" and len(o.token_ids) == RESPONSE_LEN for o in ray.get(load)
    )
