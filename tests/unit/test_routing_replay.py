"""Routing replay (R3) on the scripted engine: routed experts aligned with ``input_ids`` across
tool turns, resumed generations and context re-renders; verl's padding layout; the key off adds
nothing; a dense model is refused at start-up (SGLang's server: test_sglang_routing_replay)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf

from agentloop.batch.postprocess import postprocess
from agentloop.batch.routed_experts import (
    FILL,
    PROMPT_START_KEY,
    RoutedExpertsTrace,
    join_routed_experts,
    merge_rows,
)
from agentloop.config import default_config
from agentloop.errors import ConfigError
from agentloop.loops.tool_agent import ToolAgentLoop
from agentloop.rollout.worker import AgentLoopWorker
from agentloop.routing import AsyncLLMServerManager
from agentloop.testing import FakeTokenizer, ScriptedServer
from agentloop.testing.fake_tokenizer import IM_END
from agentloop.testing.scripted import fake_routed_experts
from agentloop.types import AgentLoopOutput, TokenOutput

TOK = FakeTokenizer()
SHAPE = (3, 2)  # layers, top_k


def expected(ids: list[int]) -> np.ndarray:
    """The scripted engine's routing of every position of ``ids``."""
    return fake_routed_experts(ids, 0, SHAPE)


def call(name: str, **args: Any) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": args})}</tool_call>'


def say(text: str) -> list[int]:
    return TOK.encode(text) + [IM_END]


@pytest.fixture
def tool_yaml(tmp_path: Path) -> str:
    p = tmp_path / "tools.yaml"
    p.write_text("tools:\n  - class_name: agentloop.tools.calculator.CalculatorTool\n")
    return str(p)


def run_tool_agent(tool_yaml: str, script: list, routed: tuple[int, int] | None = SHAPE,
                   **multi_turn: Any) -> tuple[AgentLoopOutput, ScriptedServer]:
    cfg = default_config()
    cfg.data.max_prompt_length, cfg.data.max_response_length = 256, 400
    OmegaConf.resolve(cfg)
    rollout = cfg.actor_rollout_ref.rollout
    rollout.multi_turn.tool_config_path = tool_yaml
    for k, v in multi_turn.items():
        rollout.multi_turn[k] = v
    server = ScriptedServer(script, eos_token_id=IM_END, routed_experts=routed)

    async def go() -> Any:
        ToolAgentLoop.init_class(rollout, TOK)
        loop = ToolAgentLoop(rollout, AsyncLLMServerManager([server]), TOK)
        return await loop.run({}, raw_prompt=[{"role": "user", "content": "What is 2 + 3?"}])

    return asyncio.run(go()), server


def test_tool_agent_rows_cover_prompt_sampled_and_tool_tokens(tool_yaml: str) -> None:
    first, second = say(call("calculator", expression="2 + 3")), say("It is 5.")
    out, server = run_tool_agent(tool_yaml, [first, second])
    ids = out.prompt_ids + out.response_ids
    rows = np.asarray(out.routed_experts)
    # every token but the last sampled one ran through the model: the tool turn in turn 2's prefill
    assert rows.shape == (len(ids) - 1, *SHAPE)
    assert np.array_equal(rows, expected(ids)[:-1])
    # turn 2 asked only for what turn 1 did not run: from turn 1's last sampled token on
    first_run = len(out.prompt_ids) + len(first) - 1
    assert PROMPT_START_KEY not in server.calls[0]["sampling_params"]
    assert server.calls[1]["sampling_params"][PROMPT_START_KEY] == first_run


def test_a_trailing_tool_turn_no_call_ran_is_filled_in_the_batch(tool_yaml: str) -> None:
    first = say(call("calculator", expression="2 + 3"))
    out, _ = run_tool_agent(tool_yaml, [first], max_assistant_turns=2, max_user_turns=1)
    n_ran = len(out.prompt_ids) + len(first) - 1
    assert out.status == "max_turns" and len(out.response_ids) > len(first)  # ends on a tool turn
    assert np.asarray(out.routed_experts).shape[0] == n_ran
    batch = postprocess([out], prompt_length=256, response_length=400, pad_token_id=0,
                        routed_experts_shape=SHAPE)
    col = batch.batch["routed_experts"][0].numpy()
    start = 256 - len(out.prompt_ids)
    ids = out.prompt_ids + out.response_ids
    assert np.array_equal(col[start:start + n_ran], expected(ids)[:n_ran])
    assert (col[:start] == FILL).all() and (col[start + n_ran:] == FILL).all()


def test_the_key_off_costs_nothing(tool_yaml: str) -> None:
    first, second = say(call("calculator", expression="2 + 3")), say("It is 5.")
    out, server = run_tool_agent(tool_yaml, [first, second], routed=None)
    assert out.routed_experts is None
    assert all(PROMPT_START_KEY not in c["sampling_params"] for c in server.calls)
    batch = postprocess([out], prompt_length=256, response_length=400, pad_token_id=0)
    assert "routed_experts" not in set(batch.batch.keys())


def test_a_resumed_generation_joins_its_pieces_rows() -> None:
    async def main() -> tuple[TokenOutput, list[int]]:
        server = ScriptedServer(
            lambda prompt, params, rid: list(range(100, 100 + int(params["max_tokens"]))),
            token_delay=0.02, routed_experts=SHAPE,
        )
        router = AsyncLLMServerManager([server], partial_rollout=True)
        prompt = [5, 6, 7, 8]
        task = asyncio.ensure_future(router.generate("r", prompt_ids=prompt,
                                                     sampling_params={"max_tokens": 12}))
        while not server.calls:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)
        await server.pause()
        await server.resume()
        out = await task
        assert len(server.calls) == 2 and out.num_preempted == 1
        return out, prompt

    out, prompt = asyncio.run(main())
    ids = prompt + out.token_ids
    assert len(out.token_ids) == 12
    assert np.array_equal(np.asarray(out.routed_experts), expected(ids)[:-1])


def test_merge_keeps_earlier_rows_and_fills_gaps() -> None:
    a, b = np.ones((3, *SHAPE), np.uint8), 2 * np.ones((4, *SHAPE), np.uint8)
    assert merge_rows(a, 1, b)[:3].tolist() == a.tolist()  # a re-run prefix keeps its first rows
    assert merge_rows(a, 1, b).shape[0] == 5
    gap = merge_rows(a, 5, b)
    assert gap.shape[0] == 9 and (gap[3:5] == FILL).all()
    pieces = [TokenOutput(token_ids=[1], routed_experts=a, routed_experts_start=2),
              TokenOutput(token_ids=[2], routed_experts=b, routed_experts_start=2)]
    joined = join_routed_experts(pieces)
    assert joined["routed_experts_start"] == 2 and joined["routed_experts"].shape[0] == 4


def test_a_prompt_that_does_not_extend_the_known_tokens_starts_afresh() -> None:
    trace = RoutedExpertsTrace()
    ids = [1, 2, 3]
    trace.add(ids, TokenOutput(token_ids=[4], routed_experts=expected([1, 2, 3, 4])[:-1]))
    assert trace.request([1, 2, 3, 4, 9]) == {PROMPT_START_KEY: 3}
    assert trace.rows_for([1, 2, 7, 8]).shape[0] == 2  # the shared prefix only
    assert trace.request([1, 5, 6]) == {} and trace.rows is None  # a re-rendered context


def test_padding_follows_left_and_right_padding_and_cuts() -> None:
    def row(prompt: list[int], response: list[int]) -> AgentLoopOutput:
        ids = prompt + response
        return AgentLoopOutput(prompt_ids=prompt, response_ids=response,
                               response_mask=[1] * len(response),
                               routed_experts=expected(ids)[:len(ids) - 1])

    long_prompt = row(list(range(10, 16)), [30, 31])  # prompt 6 > 4: keeps its last 4
    long_response = row([1, 2], [40, 41, 42, 43, 44])  # response 5 > 3: keeps its first 3
    failed = AgentLoopOutput(prompt_ids=[1], response_ids=[], response_mask=[])
    batch = postprocess([long_prompt, long_response, failed], prompt_length=4, response_length=3,
                        pad_token_id=0)
    col = batch.batch["routed_experts"]
    assert col.shape == (3, 7, *SHAPE) and str(col.dtype) == "torch.int16"
    ids0 = list(range(10, 16)) + [30, 31]
    assert np.array_equal(col[0, :5].numpy(), expected(ids0)[2:7])  # the cut head's rows dropped
    assert (col[0, 5:] == FILL).all()  # the last sampled token never ran
    ids1 = [1, 2, 40, 41, 42, 43, 44]
    assert (col[1, :2] == FILL).all() and np.array_equal(col[1, 2:].numpy(), expected(ids1)[:5])
    assert (col[2] == FILL).all()


def moe_dir(tmp_path: Path, **config: Any) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 3, **config}))
    return str(tmp_path)


def test_worker_builds_the_column_for_every_row_with_the_key_on(tmp_path: Path) -> None:
    def script(ids: list[int], params: dict[str, Any], rid: str) -> list[int]:
        if TOK.decode(ids).count("question 1"):
            raise RuntimeError("engine exploded")
        return [70, 71, IM_END]

    from agentloop.batch.protocol import DataProto

    rollout = default_config()
    rollout.data.max_prompt_length, rollout.data.max_response_length = 64, 16
    OmegaConf.resolve(rollout)
    r = rollout.actor_rollout_ref.rollout
    r.enable_rollout_routing_replay = True
    model = OmegaConf.create({"path": moe_dir(tmp_path, num_experts=8, num_experts_per_tok=2)})
    worker = AgentLoopWorker.from_slices(
        r, model, [ScriptedServer(script, eos_token_id=IM_END, routed_experts=SHAPE)],
        tokenizer=TOK,
    )
    prompts = np.empty(2, dtype=object)
    prompts[:] = [[{"role": "user", "content": f"question {i}"}] for i in range(2)]
    batch = DataProto(batch=None, non_tensor_batch={"raw_prompt": prompts}, meta_info={})
    out = asyncio.run(worker.generate_sequences(batch))
    col = out.batch["routed_experts"]
    assert col.shape == (2, 80, *SHAPE)
    assert list(out.non_tensor_batch["status"]) == ["stop", "error"]
    assert (col[1] == FILL).all() and (col[0] != FILL).any()


def manager_cfg(model_path: str, **rollout: Any) -> Any:
    cfg = default_config()
    OmegaConf.update(cfg, "actor_rollout_ref.model.path", model_path)
    OmegaConf.update(cfg, "actor_rollout_ref.rollout.enable_rollout_routing_replay", True)
    for k, v in rollout.items():
        OmegaConf.update(cfg, f"actor_rollout_ref.rollout.{k}", v)
    return cfg


def test_a_dense_model_is_refused_before_ray_starts(tmp_path: Path) -> None:
    import ray

    from agentloop.rollout.manager import AgentLoopManager

    dense = moe_dir(tmp_path, intermediate_size=64)
    with pytest.raises(ConfigError, match="enable_rollout_routing_replay is on but the model .* "
                                          "is dense"):
        AgentLoopManager(manager_cfg(dense))
    assert not ray.is_initialized()


def test_sglang_takes_the_key_like_vllm(tmp_path: Path) -> None:
    from agentloop.config import ServerSections
    from agentloop.rollout.routing_replay import check_routing_replay

    moe = moe_dir(tmp_path, num_local_experts=8, num_experts_per_tok=2)
    sections = ServerSections.from_root(manager_cfg(moe, name="sglang"))
    assert check_routing_replay(sections.engine, sections.model_config) == (3, 2)


class TwoGuesses:
    """An environment that says 'again' once, then ends the episode."""

    def __init__(self) -> None:
        self.steps = 0

    def reset(self, sample: dict[str, Any]) -> Any:
        from agentloop.envs import EnvReset

        return EnvReset([{"role": "user", "content": "Guess a number."}])

    def step(self, turn: Any) -> Any:
        from agentloop.envs import EnvStep

        self.steps += 1
        return EnvStep([{"role": "user", "content": "again"}], reward=0.0, done=self.steps >= 2)


def test_env_agent_rows_cover_observation_turns() -> None:
    from agentloop.envs import register_env
    from agentloop.loops.env_agent import EnvAgentLoop

    register_env("rr_two_guesses")(TwoGuesses)
    cfg = default_config()
    cfg.data.max_prompt_length, cfg.data.max_response_length = 256, 400
    OmegaConf.resolve(cfg)
    rollout = cfg.actor_rollout_ref.rollout
    server = ScriptedServer([say("3"), say("5")], eos_token_id=IM_END, routed_experts=SHAPE)

    async def go() -> Any:
        EnvAgentLoop.init_class(rollout, TOK)
        loop = EnvAgentLoop(rollout, AsyncLLMServerManager([server]), TOK)
        return await loop.run({}, raw_prompt=[], extra_info={"env": "rr_two_guesses"})

    out = asyncio.run(go())
    ids = out.prompt_ids + out.response_ids
    assert out.status == "stop" and len(server.calls) == 2
    # the observation after turn 1 ran in turn 2's prefill; the episode ends on turn 2's last token
    assert np.array_equal(np.asarray(out.routed_experts), expected(ids)[:-1])
    assert server.calls[1]["sampling_params"][PROMPT_START_KEY] == len(out.prompt_ids) + 1


def test_error_rows_no_worker_rolled_out_carry_the_column() -> None:
    from agentloop.batch.protocol import DataProto
    from agentloop.config import EngineConfig
    from agentloop.rollout.episodes import error_batch
    from agentloop.types import RolloutStatus

    cfg = default_config()
    cfg.data.max_prompt_length, cfg.data.max_response_length = 8, 4
    OmegaConf.resolve(cfg)
    chunk = DataProto(batch=None, non_tensor_batch={"uid": np.array(["a", "b"], dtype=object)},
                      meta_info={})
    out = error_batch(chunk, RolloutStatus.ERROR, "worker died", engine=EngineConfig.from_root(cfg),
                      calculate_log_probs=False, pad_token_id=0, default_agent="single_turn_agent",
                      routed_experts_shape=SHAPE)
    assert out.batch["routed_experts"].shape == (2, 12, *SHAPE)
    assert (out.batch["routed_experts"] == FILL).all()


def test_engine_args_ask_vllm_for_routed_experts_on_gpu_and_refuse_cpu(tmp_path: Path) -> None:
    from agentloop.config import resolve_config
    from agentloop.servers.vllm_io import ROUTING_REPLAY_ON_CPU, engine_args

    cfg = manager_cfg(moe_dir(tmp_path, num_experts=8, num_experts_per_tok=2))
    on = resolve_config(cfg)
    args = engine_args(on.engine, on.server, on.model_config, on_cpu=False)
    assert args["enable_return_routed_experts"] is True
    with pytest.raises(ConfigError, match="vLLM CPU cannot") as err:
        engine_args(on.engine, on.server, on.model_config, on_cpu=True)
    assert str(err.value) == ROUTING_REPLAY_ON_CPU
    OmegaConf.update(cfg, "actor_rollout_ref.rollout.enable_rollout_routing_replay", False)
    off = resolve_config(cfg)
    assert "enable_return_routed_experts" not in engine_args(
        off.engine, off.server, off.model_config, on_cpu=False
    )


def test_vllm_sampling_params_skip_the_known_prefix() -> None:
    from agentloop.servers.vllm_io import sampling_params

    params = sampling_params({PROMPT_START_KEY: 5}, 8, 16, 16)
    assert params.routed_experts_prompt_start == 5
    assert sampling_params({}, 8, 16, 16).routed_experts_prompt_start == 0
