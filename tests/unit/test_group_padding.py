"""Issue 33 item 1: runs of finished samples padded while the rest run
(agentloop.rollout.group_padding), joined into exactly what one postprocess call gives."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from agentloop.batch.postprocess import join_padded
from agentloop.batch.protocol import DataProto
from agentloop.errors import DatasetError
from agentloop.rollout.group_padding import GroupPadder
from agentloop.types import AgentLoopMetrics, AgentLoopOutput, RolloutStatus
from tests.unit.padding_helpers import assert_same_rows, pad_range


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
    return pad_range(outputs, a, b, prompt_length=6)




@pytest.mark.parametrize("cuts", [[0, 40], [0, 1, 40], [0, 13, 27, 40], [0, 39, 40]])
def test_joined_runs_equal_one_call(cuts: list[int]) -> None:
    outputs = [_output(i) for i in range(40)]
    parts = [_pad(outputs, a, b) for a, b in zip(cuts, cuts[1:], strict=False)]
    joined = join_padded(parts)
    assert joined is not None
    assert_same_rows(joined, _pad(outputs, 0, 40))


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
    assert_same_rows(groups[0], _pad(outputs, 0, 30))
    assert_same_rows(groups[1], _pad(outputs, 30, 60))


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
    assert_same_rows(groups[0], _pad(outputs, 0, 30))


def test_padder_error_is_raised_by_one_call() -> None:
    outputs = [_output(i) for i in range(30)]
    outputs[3] = outputs[3].model_copy(update={"response_mask": [1] * 20})
    with pytest.raises(DatasetError, match="output 3:"):
        asyncio.run(_stream(outputs, [0, 30], [list(range(10)), list(range(10, 30))], 5))


def test_padder_reports_each_group_once_when_done_empty_groups_first() -> None:
    async def run() -> list[int]:
        gates = [asyncio.get_running_loop().create_future() for _ in range(5)]

        async def sample(i: int) -> int:
            await gates[i]
            return i

        tasks = [asyncio.create_task(sample(i)) for i in range(5)]
        done: list[int] = []
        GroupPadder(tasks, [0, 0, 2, 5, 5], lambda a, b: _pad([_output(i) for i in range(5)], a, b),
                    on_done=done.append)
        await asyncio.sleep(0)
        assert done == [0, 3]  # the empty groups, in the next turn
        for i in (2, 3, 0, 4):
            gates[i].set_result(None)
        for _ in range(3):
            await asyncio.sleep(0)
        assert done == [0, 3, 2]  # group 2 (rows 2-4) is done, group 1 waits for row 1
        gates[1].set_result(None)
        await asyncio.gather(*tasks)
        return done

    assert asyncio.run(run()) == [0, 3, 2, 1]
