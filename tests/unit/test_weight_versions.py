"""Per-token weight versions in the padded batch (``rollout_weight_versions``): which weights
sampled each response token when a pause and a weight update cut a generation
(async_training.partial_rollout).
"""

from __future__ import annotations

import asyncio

import pytest

from agentloop.batch.postprocess import postprocess
from agentloop.errors import DatasetError
from agentloop.types import AgentLoopOutput


def out(
    response: list[int], versions: list[int] | None, mask: list[int] | None = None
) -> AgentLoopOutput:
    return AgentLoopOutput(
        prompt_ids=[1, 2], response_ids=response, response_mask=mask or [1] * len(response),
        response_weight_versions=versions,
    )


def test_versions_are_padded_per_token_with_minus_one_where_unknown() -> None:
    batch = postprocess([out([5, 6, 7, 8], [0, 0, 1, -1], mask=[1, 1, 1, 0]), out([9], None)],
                        prompt_length=3, response_length=6, pad_token_id=0)
    assert batch.batch["rollout_weight_versions"].tolist() == [[0, 0, 1, -1, -1, -1], [-1] * 6]


def test_no_column_without_versions_and_a_misaligned_list_is_refused() -> None:
    batch = postprocess([out([5, 6], None)], prompt_length=3, response_length=4, pad_token_id=0)
    assert "rollout_weight_versions" not in set(batch.batch.keys())
    with pytest.raises(
        DatasetError, match="response_weight_versions has 1 entries but response_ids has 2"
    ):
        postprocess([out([5, 6], [0])], prompt_length=3, response_length=4, pad_token_id=0)


def test_single_turn_agent_records_the_version_of_each_token_across_a_paused_update() -> None:
    from agentloop.loops.single_turn import SingleTurnAgentLoop
    from agentloop.routing.manager import AsyncLLMServerManager
    from agentloop.testing import ScriptedServer
    from agentloop.testing.fake_tokenizer import FakeTokenizer

    async def main() -> AgentLoopOutput:
        server = ScriptedServer(
            lambda prompt, params, rid: list(range(100, 100 + int(params["max_tokens"]))),
            token_delay=0.02,
        )
        router = AsyncLLMServerManager([server], partial_rollout=True)
        loop = SingleTurnAgentLoop.__new__(SingleTurnAgentLoop)
        loop.server_manager, loop.tokenizer = router, FakeTokenizer()
        loop.apply_chat_template_kwargs, loop.prompt_length, loop.response_length = {}, 64, 64
        loop.prompt_truncation = "left"
        task = asyncio.ensure_future(
            loop.run({"max_tokens": 20}, raw_prompt=[{"role": "user", "content": "hi"}])
        )
        while not server.calls:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.15)
        await server.pause()
        await server.update_weights({}, global_steps=4)
        await server.resume()
        return await task

    result = asyncio.run(main())
    versions = result.response_weight_versions
    assert versions is not None and len(versions) == len(result.response_ids) == 20
    cut = versions.index(4)
    assert 0 < cut < 20 and versions == [0] * cut + [4] * (20 - cut)
    assert (result.extra_fields["min_global_steps"], result.extra_fields["max_global_steps"]) == (
        0,
        4,
    )
