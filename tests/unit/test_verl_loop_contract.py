"""verl's agent-loop contract on agentloop: constructor, class set-up, helpers, value types and
router keywords.

The loops here are written the way verl 0.6 / 0.9 users write theirs (our own code, in their style),
and run through the real AgentLoopWorker against ScriptedServer.
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf

from agentloop.batch.protocol import DataProto
from agentloop.compat.chat_template import with_list_chat_template
from agentloop.compat.profiler import simple_timer
from agentloop.compat.wrappers import DictConfigWrap, ToolListWrap
from agentloop.config import default_config
from agentloop.loops.base import AgentLoopBase, ResolvedAgentLoop, resolve_registry
from agentloop.rollout.worker import AgentLoopWorker
from agentloop.routing import AsyncLLMServerManager, LLMServerClient
from agentloop.testing import ScriptedServer
from agentloop.testing.fake_tokenizer import IM_END, FakeTokenizer
from agentloop.testing.templates import make_template_tokenizer
from agentloop.types import AgentLoopMetrics, AgentLoopOutput, StopReason, TokenOutput


def trainer_config(**rollout: Any):
    cfg = default_config()
    cfg.data.max_prompt_length = 128
    cfg.data.max_response_length = 96
    cfg.data.apply_chat_template_kwargs = {"custom_flag": True}
    OmegaConf.resolve(cfg)
    for key, value in rollout.items():
        OmegaConf.update(cfg.actor_rollout_ref.rollout, key, value)
    return cfg


def batch(names: list[str]) -> DataProto:
    prompts = np.empty(len(names), dtype=object)
    prompts[:] = [[{"role": "user", "content": f"q{i}"}] for i in range(len(names))]
    return DataProto(
        non_tensor_batch={
            "raw_prompt": prompts, "agent_name": np.array(names, dtype=object),
            "index": np.arange(len(names)),
        }
    )


def worker_for(
    loops: dict[str, type[AgentLoopBase]], server: Any, cfg=None, tokenizer=None
) -> AgentLoopWorker:
    cfg = cfg if cfg is not None else trainer_config()
    registry = resolve_registry()
    for name, cls in loops.items():
        registry[name] = ResolvedAgentLoop(name=name, cls=cls)
    return AgentLoopWorker.from_slices(
        cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model, [server], registry=registry,
        tokenizer=tokenizer or FakeTokenizer(), trainer_config=cfg,
    )


class Verl06StyleLoop(AgentLoopBase):
    """verl 0.6 style: class-level set-up guarded by ``_class_initialized``, whole config via
    ``self.config``."""

    setups = 0

    @classmethod
    def init_class(cls, config, tokenizer, processor, **kwargs):
        if cls._class_initialized:
            return
        cls._class_initialized = True
        cls.setups += 1
        cls.response_length = config.actor_rollout_ref.rollout.response_length
        cls.template_kwargs = config.data.get("apply_chat_template_kwargs", {})

    async def run(self, sampling_params, **kwargs):
        metrics: dict[str, float] = {}
        ids = await self.loop.run_in_executor(None, lambda: self.tokenizer.apply_chat_template(
            list(kwargs["raw_prompt"]), add_generation_prompt=True, tokenize=True))
        with simple_timer("generate_sequences", metrics):
            out = await self.server_manager.generate(
                request_id="r", prompt_ids=ids, sampling_params=sampling_params, image_data=None
            )
        return AgentLoopOutput(prompt_ids=ids, response_ids=out.token_ids[: self.response_length],
                               response_mask=[1] * len(out.token_ids), num_turns=2, metrics=metrics,
                               extra_fields={"template_kwargs": dict(self.template_kwargs)})


class Verl09StyleLoop(AgentLoopBase):
    """verl 0.9 style: ``*args, **kwargs`` constructor, ``rollout_config``, worker tools,
    continuous tokens."""

    def __init__(self, *args, tools: ToolListWrap | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tool_names = [t.name for t in tools.tools] if tools else None
        self.max_turns = self.rollout_config.multi_turn.max_assistant_turns

    async def run(self, sampling_params, priority: int = 0, **kwargs):
        messages = list(kwargs["raw_prompt"])
        ids = await self.ct_build_initial_tokens(messages)
        mask: list[int] = []
        logprobs: list[float] = []
        prompt_len = len(ids)
        for turn in range(2):
            out = await self.server_manager.generate(
                request_id="x", prompt_ids=ids, sampling_params=sampling_params, image_data=None,
                video_data=None, audio_data=None, mm_processor_kwargs={}, mm_processor_output=None,
                priority=priority,
            )
            merge, mask, logprobs = await self.ct_merge_assistant_token(
                ids, out.token_ids, mask, logprobs, assistant_logprobs=out.log_probs
            )
            ids = merge.token_ids
            messages.append(
                {
                    "role": "assistant",
                    "content": self.tokenizer.decode(out.token_ids, skip_special_tokens=True),
                }
            )
            if turn == 0:
                before = list(messages)
                messages.append({"role": "tool", "content": "42"})
                merge, mask, logprobs = await self.ct_merge_context_msg(
                    before, messages, ids, mask, logprobs
                )
                ids = merge.token_ids
        return AgentLoopOutput(
            prompt_ids=ids[:prompt_len], response_ids=ids[prompt_len:], response_mask=mask,
            response_logprobs=logprobs, num_turns=4, metrics={"generate_sequences": 0.1},
            extra_fields={"tools": self.tool_names, "messages": messages},
        )


class BrokenSetupLoop(AgentLoopBase):
    @classmethod
    def init_class(cls, config, tokenizer, processor, **kwargs):
        raise RuntimeError("needs a GPU")

    async def run(self, sampling_params, **kwargs):  # pragma: no cover - never reached
        raise AssertionError


def test_verl06_style_loop_gets_whole_config_and_class_setup_runs_once():
    Verl06StyleLoop._class_initialized = False
    Verl06StyleLoop.setups = 0
    server = ScriptedServer(lambda ids, p, rid: [70, 71, IM_END], eos_token_id=IM_END)
    worker = worker_for(
        {"v06": Verl06StyleLoop}, server, tokenizer=with_list_chat_template(FakeTokenizer())
    )
    out = asyncio.run(worker.generate_sequences(batch(["v06"] * 3)))
    assert out.non_tensor_batch["status"].tolist() == ["stop"] * 3
    assert Verl06StyleLoop.setups == 1
    # data.* reached the loop
    assert out.non_tensor_batch["template_kwargs"][0] == {"custom_flag": True}
    assert out.batch["responses"][0, :3].tolist() == [70, 71, IM_END]


def test_verl09_style_loop_continuous_tokens_equal_the_full_render():
    tok = copy.deepcopy(make_template_tokenizer("chatml_hermes"))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    replies = iter([tok.encode("Let me check.", add_special_tokens=False) + [end],
                    tok.encode("It is 42", add_special_tokens=False)])  # 2nd turn cut: no end token
    server = ScriptedServer(lambda ids, p, rid: next(replies), eos_token_id=end)
    cfg = trainer_config(calculate_log_probs=True)
    cfg.data.apply_chat_template_kwargs = {}
    worker = worker_for({"v09": Verl09StyleLoop}, server, cfg=cfg, tokenizer=tok)
    out = asyncio.run(worker.generate_sequences(batch(["v09"])))
    assert out.non_tensor_batch["status"].tolist() == ["stop"]
    n = int(out.batch["attention_mask"][0, 128:].sum())
    prompt = out.batch["prompts"][0][out.batch["attention_mask"][0, :128].bool()].tolist()
    response = out.batch["responses"][0, :n].tolist()
    messages = out.non_tensor_batch["messages"][0]
    full = tok.apply_chat_template(messages, tokenize=False)
    # the cut last turn has no end token; everything before it equals the template's render, token
    # for token
    assert tok.decode(prompt + response) == full[: full.rindex("It is 42") + len("It is 42")]
    mask = out.batch["response_mask"][0, :n].tolist()
    tool_ids = tok.encode(
        "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )
    # tool turn and the "\n" separator after <|im_end|> are mask 0
    assert sum(mask) == n - len(tool_ids) - 1
    # the worker's (empty) tool list arrived as ToolListWrap
    assert out.non_tensor_batch["tools"][0] == []


def test_a_loop_whose_class_setup_fails_fails_only_its_own_samples():
    server = ScriptedServer(lambda ids, p, rid: [70, IM_END], eos_token_id=IM_END)
    worker = worker_for({"broken": BrokenSetupLoop}, server)
    assert "needs a GPU" in worker.init_errors["broken"]
    out = asyncio.run(worker.generate_sequences(batch(["broken", "single_turn_agent"])))
    status = out.non_tensor_batch["status"].tolist()
    assert status == ["error", "stop"]
    assert (
        "'broken'" in out.non_tensor_batch["error"][0]
        and "needs a GPU" in out.non_tensor_batch["error"][0]
    )


def test_loop_built_by_hand_with_verl_wrappers_reads_verl_attributes():
    cfg = trainer_config()

    async def build():
        return Verl09StyleLoop(
            DictConfigWrap(cfg), AsyncLLMServerManager([ScriptedServer()]), FakeTokenizer(), None,
            dataset_cls=None, data_config=DictConfigWrap(cfg.data), tools=None,
        )

    loop = asyncio.run(build())
    assert loop.config.data.max_prompt_length == 128 and loop.rollout_config.response_length == 96
    assert loop.apply_chat_template_kwargs == {"custom_flag": True}
    with pytest.raises(AttributeError, match="porting-from-verl.md"):
        _ = loop._compute_teacher_logprobs
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        _ = loop.nonexistent


def test_verl_value_types_are_normalised():
    out = TokenOutput(token_ids=[1], stop_reason="completed", num_preempted=None)
    assert out.stop_reason == StopReason.STOP and out.num_preempted == -1
    assert TokenOutput(token_ids=[], stop_reason=None).stop_reason == StopReason.STOP
    assert TokenOutput(token_ids=[], stop_reason="aborted").stop_reason == StopReason.ABORTED
    o = AgentLoopOutput(
        prompt_ids=[1], response_ids=[2], response_mask=[1],
        metrics={"generate_sequences": 1.5, "num_preempted": None, "something_else": 3},
        mm_processor_kwargs={}, multi_modal_data={},
    )
    assert isinstance(o.metrics, AgentLoopMetrics) and o.metrics.generate_sequences == 1.5
    assert o.metrics.num_preempted == -1 and o.multi_modal_data is None
    assert AgentLoopMetrics(compute_score=0.2).compute_score == 0.2


def test_router_takes_verl_generate_keywords_and_refuses_video():
    manager = LLMServerClient(
        [ScriptedServer(lambda ids, p, rid: [5, IM_END], eos_token_id=IM_END)]
    )
    out = asyncio.run(
        manager.generate(
            "r", prompt_ids=[1, 2], sampling_params={}, image_data=None, video_data=None,
            audio_data=None, mm_processor_kwargs={}, mm_processor_output=None, priority=3,
            some_future_keyword=1,
        )
    )
    assert out.token_ids == [5, IM_END]
    with pytest.raises(NotImplementedError, match="video"):
        asyncio.run(
            manager.generate("r", prompt_ids=[1], sampling_params={}, video_data=[object()])
        )


def test_tokenize_true_returns_ids_for_loops_written_for_transformers_4():
    tok = with_list_chat_template(copy.deepcopy(make_template_tokenizer("chatml_hermes")))
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True
    )
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    as_dict = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=True, return_dict=True
    )
    assert as_dict["input_ids"] == tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=True
    )
    assert json.dumps(ids)  # plain ints


def test_context_after_a_cut_assistant_turn_closes_it_first():
    """A tool turn after a turn cut by max_tokens: the end-of-turn token is inserted (mask 0), so
    the running ids still equal the template's render of the conversation."""
    from agentloop.compat.continuous_token import ContinuousTokenBuilder

    tok = make_template_tokenizer("chatml_hermes")
    builder = ContinuousTokenBuilder(tok)
    messages = [{"role": "user", "content": "q"}]
    ids = builder.build_initial_tokens(messages)
    sampled = tok.encode("partial answer", add_special_tokens=False)  # no <|im_end|>: cut
    merge = builder.merge_assistant_tokens(ids, sampled)
    mask, logprobs = builder.align_response_metadata(
        merge, [], [], assistant_logprobs=[-0.5] * len(sampled)
    )
    history = messages + [{"role": "assistant", "content": "partial answer"}]
    updated = history + [{"role": "user", "content": "go on"}]
    merge2 = builder.merge_context_tokens(history, updated, merge.token_ids)
    assert merge2.inserted_token_ids == [tok.convert_tokens_to_ids("<|im_end|>")]
    mask, logprobs = builder.align_response_metadata(merge2, mask, logprobs)
    assert tok.decode(merge2.token_ids) == tok.apply_chat_template(
        updated, tokenize=False, add_generation_prompt=True
    )
    assert mask == [1] * len(sampled) + [0] * (len(merge2.token_ids) - len(merge.token_ids))
    assert (
        logprobs is not None
        and logprobs[: len(sampled)] == [-0.5] * len(sampled)
        and len(logprobs) == len(mask)
    )
    with pytest.raises(ValueError, match="append-only"):
        builder.merge_context_tokens(updated, history, merge2.token_ids)


class TracedLoop(AgentLoopBase):
    from agentloop.compat.rollout_trace import rollout_trace_op as _op

    @_op
    async def run(self, sampling_params, **kwargs):
        out = await self.server_manager.generate(
            request_id="t", prompt_ids=[5, 6], sampling_params=sampling_params
        )
        return AgentLoopOutput(
            prompt_ids=[5, 6], response_ids=out.token_ids, response_mask=[1] * len(out.token_ids)
        )


def test_rollout_trace_config_records_traced_loops_with_sample_attributes(tmp_path, monkeypatch):
    """verl's rollout.trace keys: the worker configures the recorder; rollout_trace_op spans carry
    the sample's step / index / rollout_n, and max_samples_per_step_per_worker limits how many
    samples are traced."""
    from agentloop.compat.rollout_trace import RolloutTraceConfig

    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("AGENTLOOP_TRACE_PATH", str(path))
    RolloutTraceConfig.reset()
    try:
        cfg = trainer_config(
            **{"trace.backend": "jsonl", "trace.max_samples_per_step_per_worker": 2}
        )
        worker = worker_for(
            {"traced": TracedLoop}, ScriptedServer(lambda ids, p, rid: [9, IM_END]), cfg=cfg
        )
        b = batch(["traced"] * 4)
        b.meta_info["global_steps"] = 7
        asyncio.run(worker.generate_sequences(b))
    finally:
        RolloutTraceConfig.reset()
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    runs = [s for s in spans if s["name"].endswith("TracedLoop.run")]
    assert len(runs) == 2  # 2 of the 4 samples traced
    assert all(s["attrs"]["step"] == 7 and s["attrs"]["rollout_n"] == 0 for s in runs)
    assert {s["outputs"]["response_ids"][0] for s in runs} == {9}


class MismatchedLoop(AgentLoopBase):
    """Cuts its response ids but not its log-probs (seen in a third-party loop)."""

    async def run(self, sampling_params, **kwargs):
        return AgentLoopOutput(prompt_ids=[5], response_ids=[7, 8], response_mask=[1, 1],
                               response_logprobs=[-0.1, -0.2, -0.3])


def test_a_malformed_trajectory_is_an_error_row_not_a_failed_batch():
    server = ScriptedServer(lambda ids, p, rid: [70, IM_END], eos_token_id=IM_END)
    worker = worker_for(
        {"bad": MismatchedLoop}, server, cfg=trainer_config(calculate_log_probs=True)
    )
    out = asyncio.run(worker.generate_sequences(batch(["bad", "single_turn_agent"])))
    assert out.non_tensor_batch["status"].tolist() == ["error", "stop"]
    assert "response_logprobs has 3 entries for 2" in out.non_tensor_batch["error"][0]
