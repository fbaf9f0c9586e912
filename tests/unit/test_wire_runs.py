"""Issue 33 item 1: a group's runs encoded for the wire while the rest ran, joined state by state
(agentloop.batch.wire_runs), load as exactly the rows joined and pickled in one piece."""

from __future__ import annotations

import asyncio
import pickle
import random
from typing import Any

import numpy as np
import pytest

from agentloop.batch.postprocess import join_padded
from agentloop.batch.protocol import DataProto
from agentloop.batch.wire_runs import EncodedRows, decode_state, merge_states, state_pads
from agentloop.rollout.group_padding import GroupPadder
from agentloop.types import AgentLoopMetrics, AgentLoopOutput, RolloutStatus
from tests.unit.padding_helpers import assert_same_rows, pad_range


def _output(i: int, top: int = 99, full: bool = False) -> AgentLoopOutput:
    rng = random.Random(i)
    n_prompt = rng.randint(1, 9)
    n_resp = 7 if full else rng.randint(0, 9)
    return AgentLoopOutput(
        prompt_ids=[rng.randint(1, top) for _ in range(n_prompt)],
        response_ids=[rng.randint(1, top) for _ in range(n_resp)],
        response_mask=[1] * n_resp,
        response_logprobs=[-rng.random() for _ in range(n_resp)],
        reward_score=float(i), num_turns=2,
        metrics=AgentLoopMetrics(generate_sequences=i / 10),
        extra_fields={"turn": i, "session_id": f"s{i}"},
        status=RolloutStatus.STOP if i % 5 else RolloutStatus.LENGTH,
    )


def _pad(outputs: list[AgentLoopOutput], a: int, b: int) -> DataProto:
    return pad_range(outputs, a, b, prompt_length=12)


def _bare(rows: DataProto) -> DataProto:
    return DataProto(rows.batch, rows.non_tensor_batch,
                     {k: v for k, v in rows.meta_info.items() if k != "metrics"})




def _states(parts: list[DataProto]) -> list[dict[str, Any]]:
    """Each part's wire state, trimmed with the padding values the parts before chose (as the
    padder encodes a group's runs)."""
    states: list[dict[str, Any]] = []
    pads: dict[str, Any] = {}
    for part in parts:
        states.append(_bare(part).wire_state(shrink=True, pads=pads))
        pads = {**state_pads(states[-1]), **pads}
    return states


def _check_merge(parts: list[DataProto]) -> dict[str, Any]:
    state = merge_states(_states(parts))
    assert state is not None
    joined = join_padded(parts)
    assert joined is not None
    assert_same_rows(decode_state(state), _bare(joined))
    return state


@pytest.mark.parametrize("cuts", [[0, 30], [0, 10, 30], [0, 1, 17, 30]])
def test_merged_states_load_as_the_joined_rows(cuts: list[int]) -> None:
    outputs = [_output(i) for i in range(30)]
    _check_merge([_pad(outputs, a, b) for a, b in zip(cuts, cuts[1:], strict=False)])


def test_runs_narrowed_differently_are_widened() -> None:
    # ids up to 99 travel as int8, up to 30,000 as int16: the join widens, values unchanged
    outputs = [_output(i, top=99 if i < 10 else 30_000) for i in range(20)]
    state = _check_merge([_pad(outputs, 0, 10), _pad(outputs, 10, 20)])
    assert state["batch"]["tensors"]["prompts"][0][1] == np.dtype(np.int16).str


def test_a_run_not_worth_trimming_joins_one_that_is() -> None:
    # every response of the first run fills its width (kept whole), the second run's are short
    outputs = [_output(i, full=i < 10) for i in range(20)]
    first = _bare(_pad(outputs, 0, 10)).wire_state(shrink=True)
    assert isinstance(first["batch"]["tensors"]["responses"][0], np.ndarray)
    _check_merge([_pad(outputs, 0, 10), _pad(outputs, 10, 20)])


def test_states_that_differ_in_form_are_not_merged() -> None:
    outputs = [_output(i) for i in range(20)]
    a, b = _bare(_pad(outputs, 0, 10)), _bare(_pad(outputs, 10, 20))
    # trimmed with padding values of their own (the first response token, the last prompt one)
    assert merge_states([a.wire_state(shrink=True), b.wire_state(shrink=True)]) is None
    assert merge_states(_states([a, b])) is not None
    # one run encoded with its derived columns left out, the other as it is
    assert merge_states([a.wire_state(shrink=True), b.wire_state(shrink=False)]) is None
    b.meta_info["note"] = "other"
    assert merge_states(_states([a, b])) is None
    assert merge_states([]) is None


def test_padder_encodes_runs_ahead_and_they_load_exactly() -> None:
    outputs = [_output(i) for i in range(40)]

    async def run() -> list[Any]:
        gates = [asyncio.get_running_loop().create_future() for _ in outputs]

        async def sample(i: int) -> int:
            await gates[i]
            return i

        tasks = [asyncio.create_task(sample(i)) for i in range(len(outputs))]
        padder = GroupPadder(tasks, [0, 40], lambda a, b: _pad(outputs, a, b), min_run=10,
                             encode=True)
        for wave in (range(0, 15), range(15, 40)):
            for i in wave:
                gates[i].set_result(None)
            for _ in range(3):
                await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return [padder.take(0)[0]]

    (rows,) = asyncio.run(run())
    assert isinstance(rows, EncodedRows) and len(rows) == 40
    want = _pad(outputs, 0, 40)
    assert rows.meta_info["metrics"] == want.meta_info["metrics"]  # stays with the worker
    assert_same_rows(pickle.loads(pickle.dumps(rows)), _bare(want))
