"""Server pause / resume and the router's partial rollouts, on ScriptedServer (no Ray, no engine).

The fake model "counts": the next token is the previous one + 1, so a generation resumed from
prompt + tokens-so-far continues exactly where it was cut, as a greedy engine does.
ScriptedServer's ``token_delay`` hands tokens out one at a time, so a pause cuts a call part-way.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from agentloop.routing.manager import AsyncLLMServerManager
from agentloop.servers.base import ServerDeadError
from agentloop.testing.scripted import ScriptedServer
from agentloop.types import StopReason, TokenOutput


def run(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test function in a fresh event loop."""
    @functools.wraps(test)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))
    return wrapper


CONTEXT = 64
"""The fake's context window: with no max_tokens a call may fill it (as vLLM's default budget)."""


def counting_server(name: str) -> ScriptedServer:
    """A greedy "counting" model: next token = previous + 1, log-prob a function of the token alone,
    replies stamped with the server's weight version."""
    def reply(prompt_ids: list[int], params: dict[str, Any], request_id: str) -> TokenOutput:
        budget = CONTEXT - len(prompt_ids)
        limit = (
            budget if params.get("max_tokens") is None else min(int(params["max_tokens"]), budget)
        )
        ids = [prompt_ids[-1] + 1 + i for i in range(max(0, limit))]
        log_probs = [-0.01 * (t % 50) for t in ids] if params.get("logprobs") else None
        return TokenOutput(
            token_ids=ids, log_probs=log_probs, stop_reason=StopReason.LENGTH, num_preempted=0,
            extra_fields={"global_steps": server.global_steps},
        )

    server = ScriptedServer(reply, token_delay=0.02, name=name)
    return server


def make(
    partial_rollout: bool = True, servers: int = 1
) -> tuple[list[ScriptedServer], AsyncLLMServerManager]:
    fakes = [counting_server(f"fake{i}") for i in range(servers)]
    return fakes, AsyncLLMServerManager(fakes, partial_rollout=partial_rollout)


PROMPT = [100, 101, 102]
PARAMS = {"temperature": 0.0, "logprobs": True, "max_tokens": 30}


async def started(server: ScriptedServer, calls: int, tokens: int = 4) -> None:
    """Wait until ``server`` got its ``calls``-th call, then for about ``tokens`` tokens of it."""
    while len(server.calls) < calls or server.paused:
        await asyncio.sleep(0.005)
    await asyncio.sleep(tokens * server.token_delay)


async def uninterrupted(params: dict[str, Any]) -> TokenOutput:
    _, manager = make()
    return await manager.generate("ref", prompt_ids=PROMPT, sampling_params=params)


@run
async def test_paused_twice_and_resumed_equals_the_uninterrupted_generation() -> None:
    want = await uninterrupted(PARAMS)
    (server,), manager = make()
    task = asyncio.ensure_future(manager.generate("r", prompt_ids=PROMPT, sampling_params=PARAMS))
    for piece in (1, 2):
        await started(server, piece)
        assert await server.pause() == 1
        await server.resume()
    out = await task

    assert out.token_ids == want.token_ids and out.log_probs == want.log_probs
    assert out.stop_reason == StopReason.LENGTH and len(out.token_ids) == 30
    assert out.num_preempted == 2 and manager.num_resumes == 2
    assert not out.preempted_by_pause
    # each piece went to the same server with the prompt grown by the tokens so far and the rest of
    # max_tokens
    assert [c["request_id"] for c in server.calls] == ["r", "r", "r"]
    done = [len(call["prompt_ids"]) - len(PROMPT) for call in server.calls]
    assert 0 == done[0] < done[1] < done[2] < 30
    for call, n in zip(server.calls, done, strict=True):
        assert call["prompt_ids"] == PROMPT + want.token_ids[:n]
        assert call["sampling_params"]["max_tokens"] == 30 - n


@run
async def test_weight_versions_are_kept_per_token_across_an_update() -> None:
    (server,), manager = make()
    task = asyncio.ensure_future(manager.generate("r", prompt_ids=PROMPT, sampling_params=PARAMS))
    await started(server, 1)
    await server.pause()
    await server.update_weights({}, global_steps=7)  # the update happens while paused
    await server.resume()
    out = await task

    cut = len(server.calls[1]["prompt_ids"]) - len(PROMPT)
    assert 0 < cut < 30
    fields = out.extra_fields
    assert fields["weight_versions"] == [0] * cut + [7] * (30 - cut)
    assert (fields["global_steps"], fields["min_global_steps"], fields["max_global_steps"]) == (
        7, 0, 7,
    )


@run
async def test_a_call_made_while_paused_waits_for_resume() -> None:
    (server,), manager = make()
    await server.pause()
    task = asyncio.ensure_future(
        manager.generate("r", prompt_ids=PROMPT, sampling_params={"max_tokens": 3})
    )
    await asyncio.sleep(0.05)
    assert not task.done()
    await server.resume()
    out = await task
    assert out.token_ids == [103, 104, 105] and out.num_preempted == 0
    assert out.extra_fields["weight_versions"] == [0, 0, 0]


@run
async def test_without_partial_rollout_a_pause_returns_the_tokens_so_far_aborted() -> None:
    (server,), manager = make(partial_rollout=False)
    task = asyncio.ensure_future(manager.generate("r", prompt_ids=PROMPT, sampling_params=PARAMS))
    await started(server, 1)
    await server.pause()
    out = await task
    await server.resume()

    assert out.stop_reason == StopReason.ABORTED and len(server.calls) == 1
    assert 0 < len(out.token_ids) < 30 and len(out.log_probs or []) == len(out.token_ids)
    assert out.token_ids == list(range(103, 103 + len(out.token_ids)))
    assert out.preempted_by_pause is True and "weight_versions" not in out.extra_fields


@run
async def test_a_callers_own_abort_is_not_resumed() -> None:
    (server,), manager = make()
    task = asyncio.ensure_future(manager.generate("r", prompt_ids=PROMPT, sampling_params=PARAMS))
    await started(server, 1)
    await manager.abort("r")
    out = await task
    assert out.stop_reason == StopReason.ABORTED and 0 < len(out.token_ids) < 30
    assert len(server.calls) == 1 and out.num_preempted == 0
    assert not out.preempted_by_pause


@run
async def test_a_caller_abort_of_a_held_resume_ends_it_with_the_tokens_so_far() -> None:
    (server,), manager = make()
    task = asyncio.ensure_future(manager.generate("r", prompt_ids=PROMPT, sampling_params=PARAMS))
    await started(server, 1)
    await server.pause()
    while len(server.calls) < 2:  # the router re-issued it; the server holds it
        await asyncio.sleep(0.005)
    await manager.abort("r")
    await server.resume()
    out = await task
    assert out.stop_reason == StopReason.ABORTED and 0 < len(out.token_ids) < 30
    assert out.num_preempted == 1 and len(server.calls) == 2


@pytest.mark.parametrize("max_tokens", [None, 12])
@run
async def test_the_joined_output_never_exceeds_what_one_call_was_allowed(
    max_tokens: int | None,
) -> None:
    params = {"logprobs": True, "max_tokens": max_tokens}
    want = await uninterrupted(params)
    (server,), manager = make()
    task = asyncio.ensure_future(manager.generate("r", prompt_ids=PROMPT, sampling_params=params))
    await started(server, 1, tokens=3)
    await server.pause()
    await server.resume()
    out = await task
    assert len(want.token_ids) == (CONTEXT - len(PROMPT) if max_tokens is None else max_tokens)
    assert out.token_ids == want.token_ids and out.num_preempted == 1


@run
async def test_a_cut_after_the_last_allowed_token_is_not_resumed() -> None:
    server = ScriptedServer(
        [
            TokenOutput(
                token_ids=[7, 8], log_probs=None, stop_reason=StopReason.ABORTED,
                extra_fields={"global_steps": 0, "preempted_by_pause": True, "max_tokens": 2},
            )
        ]
    )
    manager = AsyncLLMServerManager([server], partial_rollout=True)
    out = await manager.generate("r", prompt_ids=PROMPT, sampling_params={})
    assert (
        out.token_ids == [7, 8] and out.stop_reason == StopReason.LENGTH and len(server.calls) == 1
    )
    assert not out.preempted_by_pause


@run
async def test_an_update_cut_after_the_last_allowed_token_ends_length_without_partial_rollout() -> (
    None
):
    server = ScriptedServer(
        [
            TokenOutput(
                token_ids=[7, 8], stop_reason=StopReason.ABORTED, preempted_by_pause=True,
                cut_by_update=True, max_tokens=2, extra_fields={"global_steps": 0},
            )
        ]
    )
    manager = AsyncLLMServerManager([server], partial_rollout=False)
    out = await manager.generate("r", prompt_ids=PROMPT, sampling_params={})
    assert (
        out.token_ids == [7, 8] and out.stop_reason == StopReason.LENGTH and len(server.calls) == 1
    )
    assert not (out.preempted_by_pause or out.cut_by_update) and out.max_tokens is None


@run
async def test_a_resume_whose_server_died_fails_over() -> None:
    servers, manager = make(servers=2)
    task = asyncio.ensure_future(manager.generate("r", prompt_ids=PROMPT, sampling_params=PARAMS))
    while not any(s.calls for s in servers):
        await asyncio.sleep(0.005)
    first, second = servers if servers[0].calls else servers[::-1]
    await started(first, 1)
    await first.pause()
    while len(first.calls) < 2:  # the resume is held by the paused server
        await asyncio.sleep(0.005)
    first.kill_engine()  # ... whose engine dies before it resumes
    # resume says so (the manager then restarts it) and lets the held go
    with pytest.raises(ServerDeadError):
        await first.resume()
    out = await task
    assert out.token_ids == list(range(103, 133)) and out.num_preempted == 1
    cut = len(first.calls[1]["prompt_ids"]) - len(PROMPT)
    assert (
        cut > 0
        and second.calls[0]["prompt_ids"] == first.calls[1]["prompt_ids"]
        and len(second.calls) == 1
    )
    assert manager.num_failovers == 1 and out.extra_fields["server_index"] == servers.index(second)


@run
async def test_without_partial_rollout_restart_preempted_runs_the_cut_generation_again_from_its_start() -> (  # noqa: E501
    None
):
    want = await uninterrupted(PARAMS)
    server = counting_server("fake")
    manager = AsyncLLMServerManager([server], partial_rollout=False, restart_preempted=True)
    task = asyncio.ensure_future(manager.generate("r", prompt_ids=PROMPT, sampling_params=PARAMS))
    await started(server, 1)
    assert await server.pause() == 1
    await server.update_weights({}, global_steps=3)
    await server.resume()
    out = await task

    # the whole generation is the restarted one: same prompt, full max_tokens, only the new weight
    # version
    assert out.token_ids == want.token_ids and out.stop_reason == StopReason.LENGTH
    assert [c["prompt_ids"] for c in server.calls] == [PROMPT, PROMPT]
    assert [c["sampling_params"]["max_tokens"] for c in server.calls] == [30, 30]
    assert manager.num_restarts == 1 and manager.num_resumes == 0
    assert (out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"]) == (3, 3)
    assert not out.preempted_by_pause


@run
async def test_without_either_option_a_cut_generation_ends_aborted_with_its_tokens_so_far() -> None:
    server = counting_server("fake")
    manager = AsyncLLMServerManager([server], partial_rollout=False)
    task = asyncio.ensure_future(manager.generate("r", prompt_ids=PROMPT, sampling_params=PARAMS))
    await started(server, 1)
    await server.pause()
    out = await task
    await server.resume()
    assert out.stop_reason == StopReason.ABORTED and 0 < len(out.token_ids) < 30
    assert len(server.calls) == 1 and manager.num_restarts == 0
    # the caller's own pause: not resumed as an update's cut is
    assert out.preempted_by_pause and not out.cut_by_update


@run
async def test_a_generation_a_weight_update_cut_is_resumed_even_without_partial_rollout() -> None:
    """``server.weight_update: abort`` (the default): the manager's pause for an update tags what it
    cuts, and the router resumes those pieces whatever ``partial_rollout`` and ``restart_preempted``
    say (verl's fully-async parameter sync); a pause of the caller's own still ends the generation
    aborted (the test above).
    """
    want = await uninterrupted(PARAMS)
    for restart in (False, True):
        server = counting_server("fake")
        manager = AsyncLLMServerManager([server], partial_rollout=False, restart_preempted=restart)
        task = asyncio.ensure_future(
            manager.generate("r", prompt_ids=PROMPT, sampling_params=PARAMS)
        )
        await started(server, 1)
        assert await server.pause(for_update=True) == 1
        await server.update_weights({}, global_steps=2)
        await server.resume()
        out = await task

        assert out.token_ids == want.token_ids and out.log_probs == want.log_probs
        assert out.stop_reason == StopReason.LENGTH and out.num_preempted == 1
        assert manager.num_resumes == 1 and manager.num_restarts == 0
        cut = len(server.calls[1]["prompt_ids"]) - len(PROMPT)
        assert 0 < cut < 30 and server.calls[1]["sampling_params"]["max_tokens"] == 30 - cut
        assert out.extra_fields["weight_versions"] == [0] * cut + [2] * (30 - cut)
        assert not (out.preempted_by_pause or out.cut_by_update or out.max_tokens is not None)


@run
async def test_a_stream_a_weight_update_cut_goes_on_without_partial_rollout() -> None:
    want = await uninterrupted(PARAMS)
    server = counting_server("fake")
    manager = AsyncLLMServerManager([server], partial_rollout=False)

    async def consume() -> tuple[list[int], Any]:
        ids, last = [], None
        async for delta in manager.generate_stream("s", prompt_ids=PROMPT, sampling_params=PARAMS):
            ids += delta.token_ids
            last = delta if delta.finished else last
        return ids, last

    task = asyncio.ensure_future(consume())
    await started(server, 1)
    await server.pause(for_update=True)
    await server.update_weights({}, global_steps=4)
    await server.resume()
    ids, last = await task
    assert ids == want.token_ids and last.stop_reason == StopReason.LENGTH
    assert last.extra_fields["num_preempted"] == 1
    assert (last.extra_fields["min_global_steps"], last.extra_fields["max_global_steps"]) == (0, 4)
    assert not (last.preempted_by_pause or last.cut_by_update)


@run
async def test_a_stream_cut_by_pauses_goes_on_after_the_resume_as_one_stream() -> None:
    want = await uninterrupted(PARAMS)
    (server,), manager = make()

    async def consume() -> tuple[list[int], Any]:
        ids, last = [], None
        async for delta in manager.generate_stream("s", prompt_ids=PROMPT, sampling_params=PARAMS):
            assert last is None  # nothing after the final chunk
            ids += delta.token_ids
            if delta.finished:
                last = delta
        return ids, last

    task = asyncio.ensure_future(consume())
    await started(server, 1)
    assert await server.pause() == 1
    await server.update_weights({}, global_steps=5)
    await server.resume()
    ids, last = await task

    assert ids == want.token_ids and len(ids) == 30  # one stream, no token lost or repeated
    assert last.stop_reason == StopReason.LENGTH
    assert last.extra_fields["num_preempted"] == 1 and manager.num_resumes == 1
    assert (last.extra_fields["min_global_steps"], last.extra_fields["max_global_steps"]) == (0, 5)
    assert not last.preempted_by_pause
    cut = len(server.calls[1]["prompt_ids"]) - len(PROMPT)
    assert server.calls[1]["prompt_ids"] == PROMPT + want.token_ids[:cut]
    assert server.calls[1]["sampling_params"]["max_tokens"] == 30 - cut


@run
async def test_a_piece_that_spans_a_keep_mode_update_keeps_its_own_token_versions() -> None:
    spanned = TokenOutput(
        token_ids=[1, 2, 3], log_probs=[-0.1] * 3, stop_reason=StopReason.ABORTED,
        extra_fields={"global_steps": 1, "weight_versions": [0, 0, 1], "preempted_by_pause": True},
    )
    rest = TokenOutput(token_ids=[4, 5], log_probs=[-0.2] * 2, stop_reason=StopReason.LENGTH,
                       extra_fields={"global_steps": 2})
    server = ScriptedServer([spanned, rest])
    manager = AsyncLLMServerManager([server], partial_rollout=True)
    out = await manager.generate("r", prompt_ids=PROMPT, sampling_params={"max_tokens": 5})
    assert (
        server.calls[1]["prompt_ids"] == PROMPT + [1, 2, 3]
        and server.calls[1]["sampling_params"]["max_tokens"] == 2
    )
    assert out.token_ids == [1, 2, 3, 4, 5] and out.num_preempted == 1
    fields = out.extra_fields
    assert fields["weight_versions"] == [0, 0, 1, 2, 2]
    assert (fields["min_global_steps"], fields["max_global_steps"]) == (0, 2)
