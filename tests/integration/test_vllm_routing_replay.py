"""Routing replay (R3) through the real engine: the tiny Qwen3-MoE model on vLLM.

vLLM 0.32 returns routed experts only from its Model Runner V2, which needs Triton with a GPU
backend: on CPU the server refuses the key with a clear error (checked here without starting an
engine).  On a GPU, one manager (1 server, 1 worker, fp32, greedy, routing replay on) is shared
by the module and each row's ``routed_experts`` must equal the router top-k of a
transformers forward (``Qwen3MoeForCausalLM``, same weights, fp32) over the row's tokens: prompt,
sampled and tool tokens (a tool turn's routing comes from the next turn's prefill, which asks vLLM
only for the positions it does not know yet), with the fill value on the last sampled token (it
never ran) and on padding.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from agentloop.batch.data import rows_to_batch
from agentloop.batch.routed_experts import FILL
from agentloop.config import default_config
from agentloop.loops.base import register
from agentloop.loops.tool_agent import ToolAgentLoop
from agentloop.parsers.base import FunctionCall

pytestmark = pytest.mark.integration
on_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                            reason="vLLM returns routed experts on GPUs only (Model Runner V2)")

PROMPT_LEN, RESPONSE_LEN = 128, 96


class CalcAlways:
    """Reads every assistant turn as a calculator call (the random model never calls tools)."""

    async def extract_tool_calls(
        self, response_ids: list[int], tools: Any
    ) -> tuple[str, list[FunctionCall]]:
        args = json.dumps({"expression": "2 + 3"})
        return "", [FunctionCall(name="calculator", arguments=args, id="call_calc")]


class CalcAgent(ToolAgentLoop):
    """tool_agent whose turns are one sampled token each (every id stops the engine) and always
    call the calculator: 3 turns with 2 tool turns between them (status max_turns)."""

    @classmethod
    def init_class(
        cls, config: Any, tokenizer: Any, processor: Any | None = None, **kwargs: Any
    ) -> None:
        super().init_class(config, tokenizer, processor, **kwargs)
        cls.tool_parser = CalcAlways()  # type: ignore[assignment]

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        every_id = list(range(len(self.tokenizer)))
        return await super().run({**sampling_params, "stop_token_ids": every_id}, **kwargs)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from agentloop.testing.tiny_moe import ensure_tiny_moe_model

    return str(ensure_tiny_moe_model(tmp_path_factory.mktemp("moe") / "tiny-qwen3-moe"))


@pytest.fixture(scope="module")
def hf_model(model_path):
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def config(model_path: str, tools: Any, device: str) -> Any:
    cfg = default_config()
    for k, v in {
        "actor_rollout_ref.model.path": model_path, "data.max_prompt_length": PROMPT_LEN,
        "data.max_response_length": RESPONSE_LEN, "actor_rollout_ref.rollout.dtype": "float32",
        "actor_rollout_ref.rollout.temperature": 0,
        "actor_rollout_ref.rollout.ignore_eos": True,  # the random model may stop at once
        "actor_rollout_ref.rollout.enable_rollout_routing_replay": True,
        "actor_rollout_ref.rollout.free_cache_engine": False,
        "actor_rollout_ref.rollout.max_num_seqs": 8,
        "actor_rollout_ref.rollout.agent.num_workers": 1,
        "actor_rollout_ref.rollout.server.num_servers": 1,
        "actor_rollout_ref.rollout.server.device": device,
        "actor_rollout_ref.rollout.multi_turn.tool_config_path": str(tools),
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 3,
    }.items():
        OmegaConf.update(cfg, k, v)
    return cfg


@pytest.fixture(scope="module")
def tools(tmp_path_factory) -> Any:
    path = tmp_path_factory.mktemp("tools") / "tools.yaml"
    path.write_text("tools:\n  - class_name: agentloop.tools.calculator.CalculatorTool\n")
    return path


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_a_cpu_server_refuses_routing_replay_with_a_clear_error(model_path, tools):
    import ray

    from agentloop.errors import ServerError
    from agentloop.rollout.manager import AgentLoopManager
    from agentloop.servers.vllm_io import ROUTING_REPLAY_ON_CPU

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        with pytest.raises(ServerError) as err:
            AgentLoopManager(config(model_path, tools, "cpu"))
        assert ROUTING_REPLAY_ON_CPU in str(err.value)
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def manager(model_path, tools):
    import ray
    import ray.cloudpickle

    from agentloop.loops.base import _agent_loop_registry
    from agentloop.rollout.manager import AgentLoopManager

    register("it_calc_agent")(CalcAgent)  # only while this module's manager lives
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    m = AgentLoopManager(config(model_path, tools, "auto"))
    yield m
    m.shutdown()
    ray.shutdown()
    _agent_loop_registry.pop("it_calc_agent", None)


def hf_routing(hf_model: Any, ids: list[int]) -> np.ndarray:
    """The router's top-k experts (sorted) of every position: [n, layers, top_k]."""
    k = hf_model.config.num_experts_per_tok
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids]), output_router_logits=True).router_logits
    chosen = torch.stack([layer.reshape(len(ids), -1).topk(k, dim=-1).indices for layer in logits],
                         dim=1)
    return chosen.sort(dim=-1).values.numpy()


def check_rows(out: Any, hf_model: Any) -> int:
    """Every row's routing equals HF's on its tokens; the last (sampled) token and padding are
    filled.  Returns the tokens checked."""
    col = out.batch["routed_experts"]
    ids, mask = out.batch["input_ids"], out.batch["attention_mask"].bool()
    layers, k = hf_model.config.num_hidden_layers, hf_model.config.num_experts_per_tok
    assert col.shape == (len(out), PROMPT_LEN + RESPONSE_LEN, layers, k)
    assert col.dtype == torch.int16
    checked = 0
    for r in range(len(out)):
        tokens = ids[r][mask[r]].tolist()
        rows = col[r][mask[r]].numpy()
        want = hf_routing(hf_model, tokens)
        got = np.sort(rows, axis=-1)
        ran = len(tokens) - 1
        same = (got[:ran] == want[:ran]).all(axis=(1, 2))
        assert same.all(), f"row {r}: {int((~same).sum())} of {ran} positions differ from HF"
        assert (rows[ran] == FILL).all() and (col[r][~mask[r]] == FILL).all()
        checked += ran
    return checked


@on_gpu
def test_single_turn_rows_equal_hf_router_choices(manager, hf_model):
    prompts = [[{"role": "user", "content": q}] for q in ("What is 2 + 3?", "Say hello.")]
    out = manager.generate_sequences(rows_to_batch([{"prompt": p} for p in prompts]))
    assert "error" not in set(out.non_tensor_batch["status"]), out.non_tensor_batch.get("error")
    sampled = out.batch["response_mask"].sum(dim=1)
    assert (sampled > 1).all()  # generated tokens beyond the first ran through decode
    print(f"\nsingle_turn: {check_rows(out, hf_model)} positions equal HF's router top-k")


@on_gpu
def test_tool_turns_get_their_routing_from_the_next_prefill(manager, hf_model):
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    out = manager.generate_sequences(
        rows_to_batch([{"prompt": prompt, "agent_name": "it_calc_agent"}] * 2)
    )
    assert list(out.non_tensor_batch["status"]) == ["max_turns"] * 2, (
        out.non_tensor_batch.get("error")
    )
    real = out.batch["attention_mask"][:, PROMPT_LEN:].bool()
    assert ((out.batch["response_mask"] == 0) & real).sum(dim=1).gt(0).all()  # tool tokens
    print(f"\ntool_agent: {check_rows(out, hf_model)} positions equal HF's router top-k")
