"""ScriptedServer, the public fake engine: scripts, max_tokens/EOS stop reasons, logprobs, abort,
exhaustion."""

from __future__ import annotations

import asyncio
import math

import pytest

from agentloop.errors import ServerError
from agentloop.servers.base import LLMServer
from agentloop.testing import ScriptedServer
from agentloop.types import StopReason, TokenOutput

EOS = 2


def gen(
    server: ScriptedServer, prompt: list[int] | None = None, rid: str = "r", **params
) -> TokenOutput:
    return asyncio.run(server.generate(prompt or [5, 6, 7], params, rid))


def test_implements_the_server_protocol():
    assert isinstance(ScriptedServer(), LLMServer)
    assert ScriptedServer.supports_sleep is True


def test_list_script_is_consumed_in_order_and_exhaustion_is_clear():
    server = ScriptedServer([[10, 11], [12]], name="fake")
    assert gen(server).token_ids == [10, 11]
    assert server.remaining == 1
    assert gen(server).token_ids == [12]
    with pytest.raises(ServerError, match=r"fake: script exhausted: 2 replies were scripted"):
        gen(server, rid="third")


def test_exception_item_is_raised_and_token_output_item_returned_as_is():
    ready = TokenOutput(token_ids=[9], stop_reason=StopReason.LENGTH, extra_fields={"k": 1})
    server = ScriptedServer([RuntimeError("engine down"), ready])
    with pytest.raises(RuntimeError, match="engine down"):
        gen(server)
    assert gen(server, max_tokens=100) is ready


def test_callable_script_gets_prompt_params_and_request_id():
    seen = []

    def reply(ids, params, rid):
        seen.append((ids, params, rid))
        return [len(ids), EOS]

    server = ScriptedServer(reply, eos_token_id=EOS)
    out = gen(server, [1, 2, 3], rid="abc", temperature=0.5)
    assert out.token_ids == [3, EOS] and out.stop_reason == StopReason.STOP
    assert seen == [([1, 2, 3], {"temperature": 0.5}, "abc")]


def test_default_echo_respects_max_tokens():
    server = ScriptedServer()
    assert gen(server, [1, 2, 3, 4, 5, 6]).token_ids == [3, 4, 5, 6]
    assert gen(server, [1, 2, 3, 4, 5, 6], max_tokens=2).token_ids == [5, 6]
    assert gen(server, [1, 2, 3], max_tokens=0).token_ids == []


def test_max_tokens_truncates_with_length():
    out = gen(ScriptedServer([[1, 2, 3, 4, 5]]), max_tokens=3)
    assert out.token_ids == [1, 2, 3] and out.stop_reason == StopReason.LENGTH


def test_stop_reasons_with_eos():
    server = ScriptedServer([[1, EOS], [1, 3, 4], [1, 3], [1, EOS, 7]], eos_token_id=EOS)
    assert gen(server, max_tokens=2).stop_reason == StopReason.STOP  # EOS exactly at the limit
    assert gen(server, max_tokens=3).stop_reason == StopReason.LENGTH  # limit filled, no EOS
    assert gen(server, max_tokens=10).stop_reason == StopReason.STOP  # short reply: stop token
    out = gen(server, max_tokens=2)  # truncation lands on EOS: the engine would have stopped there
    assert out.token_ids == [1, EOS] and out.stop_reason == StopReason.STOP


def test_no_eos_configured_short_reply_is_stop():
    out = gen(ScriptedServer([[1, 2]]), max_tokens=2)
    assert out.stop_reason == StopReason.STOP


def test_logprobs_only_when_asked_and_deterministic():
    server = ScriptedServer(lambda ids, p, rid: list(range(25)))
    assert gen(server).log_probs is None
    a, b = gen(server, logprobs=True).log_probs, gen(server, logprobs=1).log_probs
    assert a == b and len(a) == 25
    assert all(math.isfinite(x) and -1.0 - 1e-9 <= x < 0 for x in a)
    assert gen(server, logprobs=True, max_tokens=4).log_probs == a[:4]


def test_records_calls():
    server = ScriptedServer()
    asyncio.run(server.generate([1, 2], {"max_tokens": 3}, "id1", image_data=["img"]))
    assert server.calls == [
        {
            "request_id": "id1", "prompt_ids": [1, 2], "sampling_params": {"max_tokens": 3},
            "image_data": ["img"],
        }
    ]


def test_abort_ends_a_pending_request_at_once():
    # only the abort can end it
    server = ScriptedServer(lambda ids, p, rid: [1, 2, 3], delay=3600.0)

    async def main():
        task = asyncio.create_task(server.generate([1], {"logprobs": True}, "slow"))
        other = asyncio.create_task(server.generate([1], {}, "other"))
        await asyncio.sleep(0.01)
        await server.abort("slow")
        out = await asyncio.wait_for(task, 30.0)  # generous: it ends at once when abort works
        assert not other.done()
        other.cancel()
        return out

    out = asyncio.run(main())
    assert out.stop_reason == StopReason.ABORTED and out.token_ids == [] and out.log_probs == []
    assert server.counts["abort"] == 1


def test_abort_of_a_finished_request_does_not_poison_the_next_turn():
    server = ScriptedServer(lambda ids, p, rid: [4], delay=0.001)

    async def main():
        await server.generate([1], {}, "conv")
        await server.abort("conv")
        return await server.generate([1], {}, "conv")

    assert asyncio.run(main()).stop_reason == StopReason.STOP


def test_delay_lets_requests_overlap():
    """The delay is a wait, not a block: every request has started before the first one replies
    (however slow the box; a blocking delay would reply to each before the next one started)."""
    started_when_replying: list[int] = []

    def reply(ids, params, rid):
        started_when_replying.append(len(server.calls))
        return [1]

    server = ScriptedServer(reply, delay=0.05)

    async def main():
        await asyncio.gather(*(server.generate([i], {}, f"r{i}") for i in range(5)))

    asyncio.run(main())
    assert started_when_replying == [5] * 5


def test_lifecycle_calls_are_counted_and_weights_kept():
    server = ScriptedServer()

    async def main():
        await server.sleep()
        await server.wake_up()
        await server.wake_up()
        await server.update_weights({"w": [1.0]})

    asyncio.run(main())
    assert server.counts == {
        "wake_up": 2, "sleep": 1, "update_weights": 1, "abort": 0, "clear_kv_cache": 0,
        "start_profile": 0, "stop_profile": 0,
    }
    assert server.weights == {"w": [1.0]}
