"""AgentLoopWorker against the ScriptedServer fake engine: batch in, verl-layout DataProto out."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from agentloop.batch.protocol import DataProto
from agentloop.config import default_config
from agentloop.errors import DatasetError, UnknownAgentError
from agentloop.loops.base import AgentLoopBase, ResolvedAgentLoop, register, resolve_registry
from agentloop.rollout.worker import AgentLoopWorker
from agentloop.testing import ScriptedServer
from agentloop.testing.fake_tokenizer import IM_END, FakeTokenizer
from agentloop.types import AgentLoopOutput


def rollout_cfg(**over: Any):
    cfg = default_config()
    cfg.data.max_prompt_length = 64
    cfg.data.max_response_length = 16
    OmegaConf.resolve(cfg)
    r = cfg.actor_rollout_ref.rollout
    for k, v in over.items():
        OmegaConf.update(r, k, v)
    return r


def make_batch(n: int, agent_names: list[str] | None = None) -> DataProto:
    prompts = np.empty(n, dtype=object)
    prompts[:] = [[{"role": "user", "content": f"question {i}"}] for i in range(n)]
    nt = {"raw_prompt": prompts, "uid": np.array([f"u{i}" for i in range(n)], dtype=object),
          "index": np.arange(n)}
    if agent_names is not None:
        nt["agent_name"] = np.array(agent_names, dtype=object)
    return DataProto(batch=None, non_tensor_batch=nt, meta_info={})


def make_worker(server: Any, registry=None, **over: Any) -> AgentLoopWorker:
    return AgentLoopWorker.from_slices(
        rollout_cfg(**over), OmegaConf.create({"path": "unused"}), [server], registry=registry,
        tokenizer=FakeTokenizer(),
    )


def run(coro):
    return asyncio.run(coro)


def test_single_turn_layout_and_fields():
    server = ScriptedServer(lambda ids, params, rid: [70, 71, 72, IM_END], eos_token_id=IM_END)
    worker = make_worker(server, calculate_log_probs=True)
    out = run(worker.generate_sequences(make_batch(3)))
    assert len(out) == 3
    assert out.batch["responses"].shape == (3, 16) and out.batch["prompts"].shape == (3, 64)
    assert out.batch["responses"][0, :4].tolist() == [70, 71, 72, IM_END]
    assert out.batch["response_mask"][0].tolist() == [1] * 4 + [0] * 12
    assert out.batch["rollout_log_probs"].shape == (3, 16)
    assert list(out.non_tensor_batch["uid"]) == ["u0", "u1", "u2"]
    assert list(out.non_tensor_batch["status"]) == ["stop"] * 3
    assert list(out.non_tensor_batch["__num_turns__"]) == [2, 2, 2]
    assert list(out.non_tensor_batch["agent_name"]) == ["single_turn_agent"] * 3
    # the prompt sent to the engine is the chat template render with a generation prompt
    sent = server.calls[0]["prompt_ids"]
    assert FakeTokenizer().decode(sent).endswith("<|im_start|>assistant\n")


def test_validate_uses_val_kwargs():
    server = ScriptedServer(lambda ids, params, rid: [70], eos_token_id=IM_END)
    worker = make_worker(server, temperature=0.9)
    batch = make_batch(1)
    run(worker.generate_sequences(batch))
    assert server.calls[-1]["sampling_params"]["temperature"] == pytest.approx(0.9)
    batch.meta_info["validate"] = True
    run(worker.generate_sequences(batch))
    assert server.calls[-1]["sampling_params"]["temperature"] == 0.0


def test_server_failure_is_recorded_not_lost():
    def script(ids, params, rid):
        if FakeTokenizer().decode(ids).count("question 1"):
            raise RuntimeError("engine exploded")
        return [70, IM_END]

    worker = make_worker(ScriptedServer(script, eos_token_id=IM_END))
    out = run(worker.generate_sequences(make_batch(3)))
    assert len(out) == 3
    status = list(out.non_tensor_batch["status"])
    assert status == ["stop", "error", "stop"]
    assert "engine exploded" in out.non_tensor_batch["error"][1]
    assert out.batch["response_mask"][1].sum() == 0


def test_unknown_agent_name_lists_registered_names():
    worker = make_worker(ScriptedServer(eos_token_id=IM_END))
    with pytest.raises(UnknownAgentError, match="single_turn_agent"):
        run(worker.generate_sequences(make_batch(2, ["single_turn_agent", "nope_agent"])))


def test_missing_raw_prompt_column_is_named():
    worker = make_worker(ScriptedServer(eos_token_id=IM_END))
    batch = DataProto(
        batch=None, non_tensor_batch={"uid": np.array(["a"], dtype=object)}, meta_info={}
    )
    with pytest.raises(DatasetError, match="raw_prompt"):
        run(worker.generate_sequences(batch))


class TwoTrajectoryLoop(AgentLoopBase):
    async def run(self, sampling_params, **kwargs):
        outs = []
        for k in range(2):
            o = await self.server_manager.generate(
                request_id=f"{kwargs['uid']}-{k}", prompt_ids=[5, 6, 7],
                sampling_params=sampling_params,
            )
            outs.append(AgentLoopOutput(prompt_ids=[5, 6, 7], response_ids=o.token_ids,
                                        response_mask=[1] * len(o.token_ids), num_turns=2))
        return outs


def test_multi_trajectory_rows_keep_sample_fields():
    registry = resolve_registry()
    registry["two"] = ResolvedAgentLoop(name="two", cls=TwoTrajectoryLoop)
    worker = make_worker(
        ScriptedServer(lambda ids, p, rid: [80, IM_END], eos_token_id=IM_END), registry=registry
    )
    out = run(worker.generate_sequences(make_batch(3, ["two", "single_turn_agent", "two"])))
    assert len(out) == 5
    assert list(out.non_tensor_batch["uid"]) == ["u0", "u0", "u1", "u2", "u2"]
    assert list(out.non_tensor_batch["index"]) == [0, 0, 1, 2, 2]


def test_prompt_truncation_left_counted_or_error():
    server = ScriptedServer(lambda ids, p, rid: [70, IM_END], eos_token_id=IM_END)
    batch = make_batch(1)
    batch.non_tensor_batch["raw_prompt"][0] = [{"role": "user", "content": "x" * 200}]
    out = run(make_worker(server).generate_sequences(batch))
    assert len(server.calls[-1]["prompt_ids"]) == 64
    assert out.non_tensor_batch["prompt_truncated"][0] > 0
    out = run(make_worker(server, **{"agent.prompt_truncation": "error"}).generate_sequences(batch))
    assert out.non_tensor_batch["status"][0] == "error"
    assert "prompt_length" in out.non_tensor_batch["error"][0]


def test_sample_timeout_becomes_status():
    server = ScriptedServer(lambda ids, p, rid: [70, IM_END], eos_token_id=IM_END, delay=0.5)
    out = run(
        make_worker(server, **{"agent.sample_timeout": 0.05}).generate_sequences(make_batch(2))
    )
    assert list(out.non_tensor_batch["status"]) == ["timeout", "timeout"]


def test_register_decorator_and_yaml_registry(tmp_path):
    @register("unit_custom_agent")
    class Custom(TwoTrajectoryLoop):
        pass

    cfg_file = tmp_path / "agents.yaml"
    cfg_file.write_text(
        "- name: yaml_agent\n  _target_: "
        "agentloop.loops.single_turn.SingleTurnAgentLoop\n  foo: 1\n"
    )
    reg = resolve_registry(str(cfg_file))
    assert reg["unit_custom_agent"].cls is Custom
    assert reg["yaml_agent"].kwargs == {"foo": 1}


def test_missing_agent_name_values_use_default():
    server = ScriptedServer(lambda ids, p, rid: [70, IM_END], eos_token_id=IM_END)
    out = run(make_worker(server).generate_sequences(make_batch(2, [None, "single_turn_agent"])))
    assert list(out.non_tensor_batch["agent_name"]) == ["single_turn_agent"] * 2


def test_chunks_with_different_columns_concatenate():
    from agentloop.batch.metrics import align_keys

    ok = make_worker(ScriptedServer(lambda ids, p, rid: [70, IM_END], eos_token_id=IM_END))
    bad = make_worker(ScriptedServer(lambda ids, p, rid: (_ for _ in ()).throw(RuntimeError("x"))))
    a = run(ok.generate_sequences(make_batch(2)))
    b = run(bad.generate_sequences(make_batch(2)))
    a.batch["rm_scores"] = torch.ones(2, 16)
    out = DataProto.concat(align_keys([a, b]))
    assert len(out) == 4 and out.batch["rm_scores"][2:].sum() == 0
    assert list(out.non_tensor_batch["status"]) == ["stop", "stop", "error", "error"]


def test_loop_settings_are_read_once_per_config_object_and_never_mixed_up():
    from agentloop.loops.base import config_values
    from agentloop.loops.single_turn import SingleTurnAgentLoop

    async def build(cfg):
        return SingleTurnAgentLoop(cfg, None, FakeTokenizer())

    short, long = rollout_cfg(), rollout_cfg()
    OmegaConf.update(long, "response_length", 99)
    OmegaConf.update(long, "agent.prompt_truncation", "error")
    a, b = run(build(short)), run(build(long))
    assert (a.response_length, a.prompt_truncation) == (16, "left")
    assert (b.response_length, b.prompt_truncation) == (99, "error")
    calls = []
    read = lambda c: calls.append(c) or {"n": len(calls)}  # noqa: E731
    assert config_values(short, "probe", read) == config_values(short, "probe", read) == {"n": 1}
    assert config_values(long, "probe", read) == {"n": 2}


class NapLoop(AgentLoopBase):
    """Sleeps the seconds its prompt ends with ("... 0.5"), then generates once."""

    async def run(self, sampling_params, **kwargs):
        await asyncio.sleep(float(kwargs["raw_prompt"][0]["content"].split()[-1]))
        o = await self.server_manager.generate(request_id=kwargs["uid"], prompt_ids=[5, 6, 7],
                                               sampling_params=sampling_params)
        return AgentLoopOutput(
            prompt_ids=[5, 6, 7], response_ids=o.token_ids, response_mask=[1] * len(o.token_ids)
        )


def nap_batch(seconds: list[float]) -> DataProto:
    batch = make_batch(len(seconds), ["nap"] * len(seconds))
    batch.non_tensor_batch["raw_prompt"][:] = [
        [{"role": "user", "content": f"nap {s}"}] for s in seconds
    ]
    return batch


def nap_worker() -> AgentLoopWorker:
    registry = resolve_registry()
    registry["nap"] = ResolvedAgentLoop(name="nap", cls=NapLoop)
    return make_worker(
        ScriptedServer(lambda ids, p, rid: [80, IM_END], eos_token_id=IM_END), registry=registry
    )


def test_the_stream_yields_each_group_when_done_with_its_stats():
    worker = nap_worker()

    async def go() -> list[Any]:
        return [
            x
            async for x in worker.generate_sequences_stream(
                nap_batch([0.3, 0.3, 0.0, 0.0, 0.1]), [0, 2, 4, 5]
            )
        ]

    got = run(go())
    # the empty group at once, then in completion order
    assert [g for g, _, _ in got] == [3, 1, 2, 0]
    sizes = {g: len(rows) for g, rows, _ in got}
    assert sizes == {0: 2, 1: 2, 2: 1, 3: 0}
    for _, rows, stats in got:
        assert "metrics" not in rows.meta_info and len(stats.metrics) == len(rows)
        assert stats.server_failovers == 0
    assert list(dict((g, r) for g, r, _ in got)[0].non_tensor_batch["index"]) == [0, 1]


def test_a_batch_deadline_turns_the_samples_still_running_into_timeout_rows():
    worker = nap_worker()
    out = run(worker.generate_sequences(nap_batch([0.0, 30.0, 0.0]), timeout=0.5))
    assert list(out.non_tensor_batch["status"]) == ["stop", "timeout", "stop"]
    assert "agent.batch_timeout" in out.non_tensor_batch["error"][1]
    # in-process, the rows carry their metrics as verl's layout does
    assert len(out.meta_info["metrics"]) == 3
