"""Issue 33 item 1: the stack's serial cost per batch cut without changing a value.

DataProto's numpy concat and pickling, the vectorised row fill, pooled ids, the encoded-turn memory,
the episode list and the per-group ``done_at`` / ``agent_loop/serial/after_last_sample`` timing.
"""

from __future__ import annotations

import asyncio
import pickle
import time
import uuid
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict
from transformers import AutoTokenizer

from agentloop.batch.metrics import after_last_sample
from agentloop.batch.postprocess import fill_rows
from agentloop.batch.protocol import DataProto
from agentloop.config import default_config
from agentloop.rollout.episodes import to_episode
from agentloop.rollout.worker import AgentLoopWorker
from agentloop.testing import ScriptedServer
from agentloop.testing.fake_tokenizer import IM_END, FakeTokenizer
from agentloop.testing.tiny_model import ensure_tiny_model
from agentloop.tokenization import turn_cache
from agentloop.tokenization.incremental import encode_new_turns
from agentloop.types import AgentLoopOutput, MultiTrajectoryAgentLoopOutput
from agentloop.utils.ids import fresh_hex


def _part(rows: int, seed: int) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    batch = TensorDict(
        {
            "input_ids": torch.randint(0, 30000, (rows, 40), generator=g),
            "attention_mask": torch.randint(0, 2, (rows, 40), generator=g),
            "log_probs": torch.rand((rows, 8), generator=g),
            "flags": torch.rand((rows,), generator=g) > 0.5,
        },
        batch_size=[rows],
    )
    return DataProto(batch=batch, non_tensor_batch={"uid": np.arange(rows).astype(object)})


def test_concat_equals_torch_cat_values_and_dtypes():
    parts = [_part(n, i) for i, n in enumerate((3, 128, 1))]
    out = DataProto.concat(parts)
    expected = torch.cat([p.batch for p in parts], dim=0)
    assert out.batch is not None and list(out.batch.keys()) == list(expected.keys())
    assert out.batch.batch_size == expected.batch_size
    for key in list(expected.keys()):  # TensorDict: iterating it walks rows
        assert out.batch[key].dtype == expected[key].dtype
        assert torch.equal(out.batch[key], expected[key])


def test_concat_falls_back_for_unplain_batches():
    a, b = _part(2, 0), _part(2, 1)
    assert b.batch is not None
    b.batch["input_ids"] = b.batch["input_ids"].to(torch.int32)  # dtypes differ: torch.cat rules
    out = DataProto.concat([a, b])
    assert torch.equal(
        out.batch["input_ids"], torch.cat([a.batch["input_ids"], b.batch["input_ids"]])
    )


def test_pickled_batch_round_trips_exactly():
    part = _part(200, 3)
    back = pickle.loads(pickle.dumps(part))
    for key in list(part.batch.keys()):
        assert back.batch[key].dtype == part.batch[key].dtype
        assert torch.equal(back.batch[key], part.batch[key])


@pytest.mark.parametrize("left", [False, True])
def test_fill_rows_one_copy_equals_row_by_row(left: bool):
    rng = np.random.default_rng(0)
    rows: list[Any] = [rng.integers(0, 9, int(n)).tolist() for n in rng.integers(0, 12, 50)]
    out = np.full((50, 8), -1, dtype=np.int64)
    kept = fill_rows(out, rows, left=left)
    expected = np.full((50, 8), -1, dtype=np.int64)
    for b, row in enumerate(rows):
        keep = row[-8:] if left else row[:8]
        if keep:
            if left:
                expected[b, 8 - len(keep):] = keep
            else:
                expected[b, :len(keep)] = keep
    assert kept == [min(len(r), 8) for r in rows]
    assert (out == expected).all()
    # an array row or an item array.array refuses takes the per-row path, same result
    mixed = np.zeros((2, 3), dtype=np.int64)
    assert fill_rows(mixed, [np.array([1, 2]), [3.0]], left=left) == [2, 1]


def test_fresh_hex_is_a_uuid4_hex():
    ids = [fresh_hex() for _ in range(600)]
    assert len(set(ids)) == 600
    for h in ids:
        u = uuid.UUID(hex=h)
        assert u.hex == h and u.version == 4 and u.variant == uuid.RFC_4122


def test_turn_memory_gives_the_same_ids(monkeypatch):
    tok = FakeTokenizer()
    turn = [{"role": "tool", "content": "5"}]
    monkeypatch.setattr(turn_cache, "TURN_CACHE_SIZE", 0)
    fresh = encode_new_turns(tok, turn)
    monkeypatch.setattr(turn_cache, "TURN_CACHE_SIZE", 4)
    turn_cache.clear_turn_cache()
    first, again = encode_new_turns(tok, turn), encode_new_turns(tok, turn)
    assert first == again == fresh and again is not first
    again.append(0)  # the caller's list is its own
    assert encode_new_turns(tok, turn) == fresh
    other = encode_new_turns(tok, [{"role": "tool", "content": "6"}])
    assert other != fresh


def test_episode_of_plain_outputs_is_the_list():
    out = AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1])
    episode = to_episode(out, "x")
    assert episode == [out] and len(out.extra_fields["session_id"]) == 32
    multi = MultiTrajectoryAgentLoopOutput(trajectories=[out], session_id="s")
    assert to_episode(multi, "x").session_id == "s"


def test_worker_groups_say_when_their_samples_finished():
    cfg = default_config()
    cfg.data.max_prompt_length, cfg.data.max_response_length = 64, 16
    OmegaConf.resolve(cfg)
    server = ScriptedServer(lambda ids, params, rid: [70, IM_END], eos_token_id=IM_END)
    worker = AgentLoopWorker.from_slices(
        cfg.actor_rollout_ref.rollout, OmegaConf.create({"path": "unused"}), [server],
        tokenizer=FakeTokenizer(),
    )
    prompts = np.empty(4, dtype=object)
    prompts[:] = [[{"role": "user", "content": f"q{i}"}] for i in range(4)]
    batch = DataProto(batch=None, non_tensor_batch={"raw_prompt": prompts}, meta_info={})

    async def groups() -> list[Any]:
        return [item async for item in worker.generate_sequences_stream(batch, [0, 2])]

    before = time.time()
    parts = asyncio.run(groups())
    assert sorted(g for g, _, _ in parts) == [0, 1]
    assert all(before <= stats.done_at <= time.time() for _, _, stats in parts)
    timing = after_last_sample([stats.done_at for _, _, stats in parts])
    assert 0.0 <= timing["agent_loop/serial/after_last_sample"] < 60
    assert after_last_sample([0.0, 0.0]) == {}


def _tool_turn(tok: Any, call_id: str) -> list[int]:
    call = {"id": call_id, "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}}}
    result = {"role": "tool", "content": "5", "tool_call_id": call_id, "name": "calculator"}
    previous = {"role": "assistant", "content": "", "tool_calls": [call]}
    return encode_new_turns(tok, [result], previous=previous)


def test_turn_memory_ignores_call_ids_only_where_the_template_drops_them(monkeypatch):
    tok = AutoTokenizer.from_pretrained(str(ensure_tiny_model()))  # Qwen-style: ids not rendered
    turn_cache.clear_turn_cache()
    monkeypatch.setattr(turn_cache, "TURN_CACHE_SIZE", 0)
    fresh = _tool_turn(tok, "call_x")
    monkeypatch.setattr(turn_cache, "TURN_CACHE_SIZE", 8)
    assert [_tool_turn(tok, f"call_{i}") for i in range(3)] == [fresh] * 3
    assert sum(len(c) for c in turn_cache._caches.values()) == 1
    # a template that writes the ids keeps them in the key (and in the ids)
    written = "(message.content or '') ~ (message.tool_call_id or '')"
    tok.chat_template = tok.chat_template.replace("(message.content or '')", written)
    assert written in tok.chat_template
    turn_cache.clear_turn_cache()
    a, b = _tool_turn(tok, "call_1"), _tool_turn(tok, "call_2")
    assert a != b and sum(len(c) for c in turn_cache._caches.values()) == 2
