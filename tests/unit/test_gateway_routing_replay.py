"""Routing replay (R3) through the gateway: a recorded trajectory carries the scripted engine's
routed experts at every position the engine ran (docs/porting-from-verl.md#routing-replay-r3)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from gateway_helpers import FakePolicy, LiveGateway, client_for, run_calculator_agent
from omegaconf import OmegaConf

from agentloop.batch.routed_experts import (
    PROMPT_START_KEY,
    call_rows,
    pad_routed_experts,
    path_rows,
    prompt_start,
)
from agentloop.gateway.framework import OpenAIAgentLoop
from agentloop.testing import ScriptedServer
from agentloop.testing.scripted import fake_routed_experts
from agentloop.types import AgentLoopOutput, TokenOutput

SHAPE = (3, 2)  # (layers, top_k)


def _run(tokenizer: Any, routed: tuple[int, int] | None, stream: bool = False
         ) -> tuple[Any, ScriptedServer]:
    server = ScriptedServer(FakePolicy(tokenizer), eos_token_id=tokenizer.eos_token_id,
                            routed_experts=routed)
    gw = LiveGateway(tokenizer, server)
    try:
        handle = gw.session()
        messages = run_calculator_agent(client_for(handle), "What is 2+3?", stream=stream)
        assert messages[-1]["content"] == "The answer is 5."
        [traj] = gw.finalize(handle.session_id)["trajectories"]
    finally:
        gw.close()
    return traj, server


@pytest.mark.parametrize("stream", [False, True])
def test_a_two_turn_trajectory_carries_the_engines_routing(tokenizer: Any, stream: bool) -> None:
    traj, server = _run(tokenizer, SHAPE, stream)
    ids = list(traj.prompt_ids) + list(traj.response_ids)
    rows = np.asarray(traj.routed_experts)
    # every position but the last sampled token (never fed to the engine) ran through it
    assert rows.shape == (len(ids) - 1, *SHAPE)
    np.testing.assert_array_equal(rows, fake_routed_experts(ids[:-1], 0, SHAPE))
    first, second = server.calls
    assert PROMPT_START_KEY not in first["sampling_params"]
    # the second turn asks only for the positions not known yet: from the first turn's last token
    sampled_first = list(traj.response_mask).index(0)
    assert first["prompt_ids"] == list(traj.prompt_ids)
    assert second["sampling_params"][PROMPT_START_KEY] == len(traj.prompt_ids) + sampled_first - 1


def test_the_row_is_padded_into_the_batch_column(tokenizer: Any) -> None:
    traj, _ = _run(tokenizer, SHAPE)
    out = AgentLoopOutput(prompt_ids=list(traj.prompt_ids), response_ids=list(traj.response_ids),
                          response_mask=list(traj.response_mask), num_turns=traj.num_turns,
                          routed_experts=traj.routed_experts)
    p, r = len(traj.prompt_ids), len(traj.response_ids)
    col = pad_routed_experts([out], np.array([2]), np.array([p]), np.array([p + r]),
                             width=p + r + 4, shape=SHAPE)
    assert col is not None and col.shape == (1, p + r + 4, *SHAPE)
    ids = list(traj.prompt_ids) + list(traj.response_ids)
    np.testing.assert_array_equal(col[0, 2:1 + p + r], fake_routed_experts(ids[:-1], 0, SHAPE))
    assert not col[0, :2].any() and not col[0, 1 + p + r:].any()  # fill: padding, last token


def test_the_key_off_records_and_asks_nothing(tokenizer: Any) -> None:
    traj, server = _run(tokenizer, None)
    assert traj.routed_experts is None
    assert all(PROMPT_START_KEY not in c["sampling_params"] for c in server.calls)


class _Manager:
    """The gateway manager an ``openai_agent`` loop talks to, over one :class:`LiveGateway`."""

    def __init__(self, gw: LiveGateway) -> None:
        self.gw = gw

    async def _on_gateway(self, coro: Any) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.gw.loop))

    async def create_session(self, **kwargs: Any) -> Any:
        return await self._on_gateway(self.gw.actor.create_session(**kwargs))

    async def finalize(self, session_id: str, longest_only: bool = False) -> dict:
        return await self._on_gateway(self.gw.actor.finalize(session_id, longest_only))

    async def abort(self, session_id: str) -> dict:
        return await self._on_gateway(self.gw.actor.abort(session_id))


def test_an_openai_agent_row_carries_the_routing(tokenizer: Any) -> None:
    server = ScriptedServer(FakePolicy(tokenizer), eos_token_id=tokenizer.eos_token_id,
                            routed_experts=SHAPE)
    gw = LiveGateway(tokenizer, server)

    async def runner(*, base_url: str, api_key: str, **kwargs: Any) -> None:
        handle = type("Handle", (), {"base_url": base_url, "api_key": api_key})()
        await asyncio.to_thread(run_calculator_agent, client_for(handle), "What is 2+3?")

    config = OmegaConf.create({"prompt_length": 512, "response_length": 256, "gateway": {}})

    async def go() -> Any:
        OpenAIAgentLoop.reset_class()
        OpenAIAgentLoop.init_class(config, tokenizer, gateway_manager=_Manager(gw))
        loop = OpenAIAgentLoop(config, None, tokenizer, runner=runner)
        return await loop.run({}, raw_prompt=[{"role": "user", "content": "x"}], index=0)

    try:
        out = asyncio.run(go())
    finally:
        OpenAIAgentLoop.reset_class()
        gw.close()
    [row] = out.trajectories
    assert row.status == "stop", row.error
    ids = row.prompt_ids + row.response_ids
    np.testing.assert_array_equal(np.asarray(row.routed_experts),
                                  fake_routed_experts(ids[:-1], 0, SHAPE))


def test_call_rows_keep_earlier_rows_and_drop_cut_tokens() -> None:
    rows = fake_routed_experts(list(range(10)), 0, SHAPE)
    out = TokenOutput(token_ids=[7, 8], routed_experts=rows, routed_experts_start=0)
    # an engine that ignored the known prefix: the known rows are not stored twice
    start, kept = call_rows(out, known=4, end=8)
    assert start == 4
    np.testing.assert_array_equal(kept, rows[4:8])
    assert call_rows(out, known=12, end=14) is None  # nothing new
    assert call_rows(TokenOutput(token_ids=[1]), known=0, end=3) is None  # the key off
    joined = path_rows([(0, rows[:3]), None, (5, rows[5:7])])
    assert joined is not None and len(joined) == 7 and not joined[3:5].any()  # a gap is fill
    assert path_rows([None, None]) is None
    assert prompt_start(None) == {} and prompt_start(rows[:3]) == {PROMPT_START_KEY: 3}


def test_sibling_branches_keep_the_routing_of_their_own_call(tokenizer: Any) -> None:
    server = ScriptedServer(FakePolicy(tokenizer), eos_token_id=tokenizer.eos_token_id,
                            routed_experts=SHAPE)
    gw = LiveGateway(tokenizer, server)
    try:
        handle = gw.session()
        client = client_for(handle)
        messages = [{"role": "user", "content": "Say a word."}]
        for _ in range(2):  # two samples of the same context: two branches
            client.chat.completions.create(model="m", messages=messages)
        trajectories = gw.finalize(handle.session_id)["trajectories"]
    finally:
        gw.close()
    assert len(trajectories) == 2
    for traj in trajectories:
        ids = list(traj.prompt_ids) + list(traj.response_ids)
        np.testing.assert_array_equal(np.asarray(traj.routed_experts),
                                      fake_routed_experts(ids[:-1], 0, SHAPE))
