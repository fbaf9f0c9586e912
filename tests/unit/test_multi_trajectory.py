"""Samples with several trajectories (episodes): every row gets trajectory_index / num_trajectories
/ session_id beside its sample's uid, on every path (worker, error rows, failed loops, several
worker chunks)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf

from agentloop import MultiTrajectoryAgentLoopOutput
from agentloop.batch.metrics import align_keys, performance_metrics
from agentloop.batch.postprocess import episode_columns, postprocess
from agentloop.batch.protocol import DataProto
from agentloop.config import default_config
from agentloop.errors import DatasetError
from agentloop.loops.base import AgentLoopBase, ResolvedAgentLoop, resolve_registry
from agentloop.rollout.worker import AgentLoopWorker, error_batch
from agentloop.testing import ScriptedServer
from agentloop.testing.fake_tokenizer import IM_END, FakeTokenizer
from agentloop.types import AgentLoopOutput, RolloutStatus


class EpisodeLoop(AgentLoopBase):
    """k = extra_info["k"] trajectories, one engine call each; ``form`` picks how they are
    returned."""

    async def run(self, sampling_params, **kwargs):
        info = kwargs["extra_info"]
        if info.get("raise"):
            raise RuntimeError("loop exploded")
        outputs = []
        for j in range(info["k"]):
            ids = self.tokenizer.apply_chat_template(
                kwargs["raw_prompt"], add_generation_prompt=True
            ) + [90 + j]
            o = await self.server_manager.generate(
                request_id=f"{kwargs['uid']}-{j}", prompt_ids=ids, sampling_params=sampling_params
            )
            outputs.append(AgentLoopOutput(prompt_ids=ids, response_ids=o.token_ids,
                                           response_mask=[1] * len(o.token_ids), num_turns=2,
                                           extra_fields={"snapshot": j < info["k"] - 1}))
        form = info.get("form", "list")
        if form == "single":
            return outputs[0]
        if form == "episode":
            return MultiTrajectoryAgentLoopOutput(
                trajectories=outputs, session_id=info.get("session_id")
            )
        if form == "empty":
            return []
        return outputs


def registry() -> dict[str, ResolvedAgentLoop]:
    reg = resolve_registry()
    reg["episode"] = ResolvedAgentLoop(name="episode", cls=EpisodeLoop)
    return reg


def make_worker() -> AgentLoopWorker:
    cfg = default_config()
    cfg.data.max_prompt_length = 64
    cfg.data.max_response_length = 16
    OmegaConf.resolve(cfg)
    server = ScriptedServer(lambda ids, params, rid: [70, 71, IM_END], eos_token_id=IM_END)
    return AgentLoopWorker.from_slices(
        cfg.actor_rollout_ref.rollout, OmegaConf.create({"path": "unused"}), [server],
        registry=registry(), tokenizer=FakeTokenizer(), trainer_config=cfg,
    )


def make_batch(infos: list[dict[str, Any]], uids: list[str] | None = None) -> DataProto:
    n = len(infos)
    prompts, extra = np.empty(n, dtype=object), np.empty(n, dtype=object)
    prompts[:] = [[{"role": "user", "content": f"question {i}"}] for i in range(n)]
    extra[:] = infos
    nt = {
        "raw_prompt": prompts, "uid": np.array(uids or [f"u{i}" for i in range(n)], dtype=object),
        "index": np.arange(n), "agent_name": np.array(["episode"] * n, dtype=object),
        "extra_info": extra,
    }
    return DataProto(batch=None, non_tensor_batch=nt, meta_info={})


def rows(out: DataProto) -> list[tuple[Any, ...]]:
    nt = out.non_tensor_batch
    return list(
        zip(
            nt["uid"].tolist(), nt["trajectory_index"].tolist(), nt["num_trajectories"].tolist(),
            strict=True,
        )
    )


def test_list_episode_and_single_outputs_get_episode_columns():
    batch = make_batch(
        [
            {"k": 3}, {"k": 1, "form": "single"}, {"k": 2, "form": "episode", "session_id": "gw-7"},
            {"k": 2},
        ]
    )
    out = asyncio.run(make_worker().generate_sequences(batch))
    assert rows(out) == [
        ("u0", 0, 3), ("u0", 1, 3), ("u0", 2, 3), ("u1", 0, 1), ("u2", 0, 2), ("u2", 1, 2),
        ("u3", 0, 2), ("u3", 1, 2),
    ]
    nt = out.non_tensor_batch
    sessions = nt["session_id"].tolist()
    assert sessions[0] == sessions[1] == sessions[2] and sessions[6] == sessions[7]
    assert sessions[4] == sessions[5] == "gw-7"  # the episode's own id is kept
    assert len({sessions[0], sessions[3], sessions[4], sessions[6]}) == 4  # one id per sample
    assert nt["index"].tolist() == [0, 0, 0, 1, 2, 2, 3, 3]  # every row keeps its sample's fields
    assert nt["snapshot"].tolist() == [True, True, False, False, True, False, True, False]
    assert nt["trajectory_index"].dtype == np.int32 and nt["num_trajectories"].dtype == np.int32
    # each row is its own trajectory: the marker token j sits at the end of trajectory j's prompt
    assert out.batch["prompts"][:3, -1].tolist() == [90, 91, 92]
    timing = performance_metrics(out, 1.0)
    assert timing["agent_loop/trajectories_per_sample/mean"] == 2.0  # (3 + 1 + 2 + 2) / 4 samples
    assert timing["agent_loop/trajectories_per_sample/max"] == 3.0


def test_repeated_uid_samples_are_separate_episodes():
    """rollout.n repeats a prompt under one uid: each repeat is its own episode (session_id),
    same group."""
    out = asyncio.run(make_worker().generate_sequences(make_batch([{"k": 2}] * 3, uids=["g"] * 3)))
    nt = out.non_tensor_batch
    assert nt["uid"].tolist() == ["g"] * 6
    sessions = nt["session_id"].tolist()
    assert sessions[0::2] == sessions[1::2] and len(set(sessions)) == 3


def test_failed_and_malformed_samples_are_single_rows_with_the_columns():
    batch = make_batch([{"k": 1, "raise": True}, {"k": 0, "form": "empty"}, {"k": 2}])
    out = asyncio.run(make_worker().generate_sequences(batch))
    assert rows(out) == [("u0", 0, 1), ("u1", 0, 1), ("u2", 0, 2), ("u2", 1, 2)]
    status = out.non_tensor_batch["status"].tolist()
    assert status == ["error", "error", "stop", "stop"]
    assert "MultiTrajectoryAgentLoopOutput" in out.non_tensor_batch["error"][1]
    assert out.non_tensor_batch["session_id"][0] != out.non_tensor_batch["session_id"][1]


def test_error_batch_and_chunk_concat_keep_the_columns():
    batch = make_batch([{"k": 2}, {"k": 1}])
    worker = make_worker()
    ok = asyncio.run(worker.generate_sequences(batch))
    dead = error_batch(
        batch, RolloutStatus.TIMEOUT, "worker gone", engine=worker.engine,
        calculate_log_probs=worker.sampling[False].calculate_log_probs, pad_token_id=0,
        default_agent="episode",
    )
    assert dead.non_tensor_batch["trajectory_index"].tolist() == [0, 0]
    assert dead.non_tensor_batch["num_trajectories"].tolist() == [1, 1]
    merged = DataProto.concat(align_keys([ok, dead]))
    assert merged.non_tensor_batch["num_trajectories"].tolist() == [2, 2, 1, 1, 1]
    assert len(set(merged.non_tensor_batch["session_id"].tolist())) == 4


def test_postprocess_direct_call_and_counts_are_checked():
    outs = [AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1]) for _ in range(3)]
    out = postprocess(outs, prompt_length=4, response_length=4, pad_token_id=0)
    assert out.non_tensor_batch["trajectory_index"].tolist() == [0, 0, 0]
    assert out.non_tensor_batch["num_trajectories"].tolist() == [1, 1, 1]
    cols = episode_columns(outs, [2, 1])
    assert cols["trajectory_index"].tolist() == [0, 1, 0] and cols["num_trajectories"].tolist() == [
        2, 2, 1,
    ]
    assert cols["session_id"][0] == cols["session_id"][1] != cols["session_id"][2]
    with pytest.raises(DatasetError, match="add up"):
        episode_columns(outs, [2, 2])


def test_episode_type_rejects_an_empty_list_and_accepts_fork_fields():
    with pytest.raises(ValueError, match="at least one trajectory"):
        MultiTrajectoryAgentLoopOutput(trajectories=[])
    one = AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1])
    episode = MultiTrajectoryAgentLoopOutput(trajectories=[one], contextpilot_branch_points=[])
    assert episode.trajectories == [one] and episode.reward_to is None
