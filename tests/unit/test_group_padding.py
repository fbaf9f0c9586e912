"""Issue 33 item 1: runs of finished samples padded while the rest run
(agentloop.rollout.group_padding), joined into exactly what one postprocess call gives."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from agentloop.batch.postprocess import join_padded, postprocess
from agentloop.batch.protocol import DataProto
from agentloop.config import default_config
from agentloop.errors import DatasetError
from agentloop.rollout import group_padding
from agentloop.rollout.group_padding import (
    PIECE_REST,
    PIECE_RUN,
    PIECE_WHOLE,
    ROW_POSITIONS,
    GroupPadder,
    StreamingPadder,
)
from agentloop.rollout.worker import AgentLoopWorker, WorkerStats
from agentloop.testing import ScriptedServer
from agentloop.testing.fake_tokenizer import IM_END, FakeTokenizer
from agentloop.types import AgentLoopMetrics, AgentLoopOutput, RolloutStatus


def _output(i: int, extra: dict[str, Any] | None = None) -> AgentLoopOutput:
    rng = random.Random(i)
    n_prompt, n_resp = rng.randint(0, 9), rng.randint(0, 9)
    return AgentLoopOutput(
        prompt_ids=[rng.randint(1, 99) for _ in range(n_prompt)],
        response_ids=[rng.randint(1, 99) for _ in range(n_resp)],
        response_mask=[rng.randint(0, 1) for _ in range(n_resp)],
        response_logprobs=[-rng.random() for _ in range(n_resp)] if i % 3 else None,
        reward_score=float(i), num_turns=i % 4,
        metrics=AgentLoopMetrics(generate_sequences=i / 10),
        extra_fields={"session_id": f"s{i}", "turn": i, **(extra or {})},
        status=RolloutStatus.STOP if i % 5 else RolloutStatus.LENGTH,
    )


def _pad(outputs: list[AgentLoopOutput], a: int, b: int) -> DataProto:
    return postprocess(
        outputs[a:b], prompt_length=6, response_length=7, pad_token_id=0,
        sample_fields={"uid": np.asarray([f"u{i}" for i in range(a, b)], dtype=object)},
        calculate_log_probs=True,
    )


def _assert_same(got: DataProto, want: DataProto) -> None:
    assert got.batch is not None and want.batch is not None
    assert list(got.batch.keys()) == list(want.batch.keys())
    for key in want.batch.keys():  # noqa: SIM118 - iterating a TensorDict walks rows
        assert got.batch[key].dtype == want.batch[key].dtype
        assert torch.equal(got.batch[key], want.batch[key]), key
    assert list(got.non_tensor_batch) == list(want.non_tensor_batch)
    for key, col in want.non_tensor_batch.items():
        assert got.non_tensor_batch[key].dtype == col.dtype
        assert got.non_tensor_batch[key].shape == col.shape
        assert got.non_tensor_batch[key].tolist() == col.tolist(), key
    assert got.meta_info == want.meta_info


@pytest.mark.parametrize("cuts", [[0, 40], [0, 1, 40], [0, 13, 27, 40], [0, 39, 40]])
def test_joined_runs_equal_one_call(cuts: list[int]) -> None:
    outputs = [_output(i) for i in range(40)]
    parts = [_pad(outputs, a, b) for a, b in zip(cuts, cuts[1:], strict=False)]
    joined = join_padded(parts)
    assert joined is not None
    _assert_same(joined, _pad(outputs, 0, 40))


def test_runs_with_other_columns_are_not_joined() -> None:
    outputs = [_output(i, {"late": 1} if i >= 20 else None) for i in range(40)]
    assert join_padded([_pad(outputs, 0, 20), _pad(outputs, 20, 40)]) is None


async def _stream(
    outputs: list[AgentLoopOutput], bounds: list[int], waves: list[list[int]], min_run: int,
    early: bool = True,
) -> tuple[list[DataProto], list[tuple[int, int]]]:
    """Samples finishing in ``waves`` (row lists, one event-loop turn each); every group taken
    once all are done.  Returns the groups' rows and the ranges padded."""
    gates = [asyncio.get_running_loop().create_future() for _ in outputs]

    async def sample(i: int) -> int:
        await gates[i]
        return i

    tasks = [asyncio.create_task(sample(i)) for i in range(len(outputs))]
    padded: list[tuple[int, int]] = []

    def pad(a: int, b: int) -> DataProto:
        assert all(t.done() for t in tasks[a:b])
        padded.append((a, b))
        return _pad(outputs, a, b)

    padder = GroupPadder(tasks, bounds, pad, early=early, min_run=min_run)
    for wave in waves:
        for i in wave:
            gates[i].set_result(None)
        for _ in range(3):
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    await asyncio.sleep(0)
    got = [padder.take(g) for g in range(len(bounds) - 1)]
    assert all(done_at > 0 for _, done_at in got)
    return [rows for rows, _ in got], padded


def test_padder_pads_runs_ahead_and_joins_them_exactly() -> None:
    outputs = [_output(i) for i in range(60)]
    waves = [list(range(0, 12)), list(range(30, 45)), list(range(12, 25)), list(range(45, 58)),
             [25, 26, 27, 28, 29, 58, 59]]
    groups, padded = asyncio.run(_stream(outputs, [0, 30, 60], waves, min_run=10))
    # ahead: 0-12 and 12-25 in group 0, 30-45 and 45-58 in group 1; then each group's rest
    assert padded == [(0, 12), (30, 45), (12, 25), (45, 58), (25, 30), (58, 60)]
    _assert_same(groups[0], _pad(outputs, 0, 30))
    _assert_same(groups[1], _pad(outputs, 30, 60))


def test_padder_off_or_small_groups_pad_once() -> None:
    outputs = [_output(i) for i in range(20)]
    waves = [list(range(0, 20))]
    _, padded = asyncio.run(_stream(outputs, [0, 10, 20], waves, min_run=10))
    assert padded == [(0, 10), (10, 20)]  # groups no larger than min_run: one call each
    _, padded = asyncio.run(_stream(outputs, [0, 20], [[0, 1, 2], list(range(3, 20))], 1, False))
    assert padded == [(0, 20)]


def test_padder_repads_when_layouts_differ() -> None:
    outputs = [_output(i, {"late": 1} if i >= 15 else None) for i in range(30)]
    groups, padded = asyncio.run(_stream(outputs, [0, 30], [list(range(15)), list(range(15, 30))],
                                         min_run=10))
    assert padded == [(0, 15), (15, 30), (0, 30)]
    _assert_same(groups[0], _pad(outputs, 0, 30))


def test_padder_error_is_raised_by_one_call() -> None:
    outputs = [_output(i) for i in range(30)]
    outputs[3] = outputs[3].model_copy(update={"response_mask": [1] * 20})
    with pytest.raises(DatasetError, match="output 3:"):
        asyncio.run(_stream(outputs, [0, 30], [list(range(10)), list(range(10, 30))], 5))


def _pad_rows(outputs: list[AgentLoopOutput], rows: Any) -> DataProto:
    """What the worker's ``pad_rows`` gives: the samples' rows padded, their positions in
    ``meta_info``."""
    rows = list(rows)
    part = postprocess(
        [outputs[i] for i in rows], prompt_length=6, response_length=7, pad_token_id=0,
        sample_fields={"uid": np.asarray([f"u{i}" for i in rows], dtype=object)},
        calculate_log_probs=True,
    )
    part.meta_info[ROW_POSITIONS] = rows
    return part


async def _ship_stream(
    outputs: list[AgentLoopOutput], bounds: list[int], waves: list[list[int]], min_run: int,
) -> tuple[list[tuple[DataProto, WorkerStats]], list[list[int]]]:
    """Samples finishing in ``waves`` (row lists, one event-loop turn each) under a
    StreamingPadder (the worker's stream): returns each group's rows and stats joined from the
    pieces sent ahead and its rest, and the rows of each padding call."""
    gates = [asyncio.get_running_loop().create_future() for _ in outputs]

    async def sample(i: int) -> int:
        await gates[i]
        return i

    tasks = [asyncio.create_task(sample(i)) for i in range(len(outputs))]
    padded: list[list[int]] = []
    items: list[list[tuple[DataProto, WorkerStats]]] = [[] for _ in bounds[:-1]]

    def pad_rows(rows: Any) -> DataProto:
        assert all(tasks[i].done() for i in rows)
        padded.append(list(rows))
        return _pad_rows(outputs, rows)

    def ship(g: int, rows: DataProto) -> None:
        items[g].append((rows, WorkerStats.take(rows, piece=PIECE_RUN)))

    padder = StreamingPadder(tasks, bounds, pad_rows, ship, min_run=min_run)
    for wave in waves:
        for i in wave:
            gates[i].set_result(None)
        for _ in range(3):
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    await asyncio.sleep(0)
    for g in range(len(bounds) - 1):
        rows, done_at, piece = padder.finish(g)
        assert done_at > 0
        stats = WorkerStats.take(rows, done_at=done_at, piece=piece)
        items[g] = [(rows, stats)] if piece == PIECE_WHOLE else [*items[g], (rows, stats)]
    return [WorkerStats.joined(group) for group in items], padded


def _assert_same_group(got: tuple[DataProto, WorkerStats], want: DataProto) -> None:
    rows, stats = got
    assert stats.metrics == want.meta_info.pop("metrics")
    assert stats.positions == want.meta_info.pop(ROW_POSITIONS)
    _assert_same(rows, want)


def test_pieces_in_finish_order_join_into_row_order_exactly() -> None:
    outputs = [_output(i) for i in range(60)]
    waves = [[3, 17, 5, 29, 0, 11, 8, 22, 14, 2, 26, 9], [40, 33, 58, 31, 47, 55, 36, 44, 50, 39],
             [1, 4, 6, 7, 10, 12, 13], [15, 16, 18, 19, 20, 21, 23, 24, 25, 27, 28],
             [30, 32, 34, 35, 37, 38, 41, 42, 43, 45, 46, 48, 49, 51, 52, 53, 54, 56, 57, 59]]
    groups, padded = asyncio.run(_ship_stream(outputs, [0, 30, 60], waves, min_run=10))
    # at least 10 waiting samples of a group still running are sent at once, sorted; what waits
    # when a group is done is its rest
    rests = [sorted(waves[2] + waves[3]), sorted(waves[4])]
    assert padded == [sorted(waves[0]), sorted(waves[1]), *rests]
    _assert_same_group(groups[0], _pad_rows(outputs, range(0, 30)))
    _assert_same_group(groups[1], _pad_rows(outputs, range(30, 60)))


def test_a_rest_of_another_layout_is_sent_whole() -> None:
    outputs = [_output(i, {"late": 1} if i >= 15 else None) for i in range(30)]
    groups, padded = asyncio.run(
        _ship_stream(outputs, [0, 30], [list(range(15)), list(range(15, 30))], min_run=10)
    )
    # the rest could not join the piece sent: the whole group again
    assert padded == [list(range(15)), list(range(15, 30)), list(range(30))]
    _assert_same_group(groups[0], _pad_rows(outputs, range(30)))


def test_a_group_with_no_piece_sent_is_sent_whole() -> None:
    outputs = [_output(i) for i in range(20)]
    groups, padded = asyncio.run(_ship_stream(outputs, [0, 20], [list(range(20))], min_run=10))
    assert padded == [list(range(20))]
    _assert_same_group(groups[0], _pad_rows(outputs, range(20)))


def _worker_and_batch(rows: int) -> tuple[AgentLoopWorker, DataProto, ScriptedServer]:
    """A worker on a scripted engine whose replies take longer for later rows (sample ``i``
    answers ``1 + i // 25`` tokens, one every 2 ms), so runs of samples finish while others run."""
    cfg = default_config()
    cfg.data.max_prompt_length, cfg.data.max_response_length = 64, 16
    OmegaConf.resolve(cfg)

    def reply(ids: list[int], params: dict[str, Any], rid: str) -> list[int]:
        row = int(FakeTokenizer().decode(ids).split("q")[-1].split("<")[0])
        return [70] * (row // 25) + [IM_END]

    server = ScriptedServer(reply, eos_token_id=IM_END, token_delay=0.002)
    worker = AgentLoopWorker.from_slices(
        cfg.actor_rollout_ref.rollout, OmegaConf.create({"path": "unused"}), [server],
        tokenizer=FakeTokenizer(),
    )
    prompts = np.empty(rows, dtype=object)
    prompts[:] = [[{"role": "user", "content": f"q{i}"}] for i in range(rows)]
    batch = DataProto(batch=None, non_tensor_batch={"raw_prompt": prompts,
                                                     "index": np.arange(rows)}, meta_info={})
    return worker, batch, server


def test_the_worker_sends_pieces_ahead_and_its_rows_equal_one_call(monkeypatch):
    """A 200-row group whose samples finish in waves comes as pieces then its rest; joined, they
    equal the rows padded in one call, column for column; with ``SHIP_RUNS`` off the runs are
    joined in the worker into one item, the same rows."""
    worker, batch, _ = _worker_and_batch(200)

    async def items() -> list[tuple[int, DataProto, WorkerStats]]:
        return [item async for item in worker.generate_sequences_stream(batch, [0])]

    def without_ids(rows: DataProto) -> DataProto:
        # a fresh id per sample: one each, not the same ones
        assert len(set(rows.non_tensor_batch.pop("session_id"))) == 200
        return rows

    got = asyncio.run(items())
    pieces = [stats.piece for _, _, stats in got]
    assert pieces[0] == PIECE_RUN and pieces[-1] == PIECE_REST, pieces
    rows, stats = WorkerStats.joined([(r, s) for _, r, s in got])
    assert stats.positions == list(range(200))
    monkeypatch.setattr(group_padding, "SHIP_RUNS", False)
    joined = asyncio.run(items())
    assert [s.piece for _, _, s in joined] == [PIECE_WHOLE] and joined[0][2].positions is None
    monkeypatch.setattr(group_padding, "MIN_RUN", 1 << 30)
    whole = asyncio.run(worker.generate_sequences(batch))
    assert len(stats.metrics) == 200 == len(whole.meta_info.pop("metrics"))
    _assert_same(without_ids(rows), without_ids(whole))
    _assert_same(without_ids(joined[0][1]), whole)
