"""VLLMServer's parts (pause gate, batcher, keep-mode in-flight update, weight loading) against a
contract fake of vLLM's ``AsyncLLM`` (no engine process, no model): the server-side protocol the
router relies on. The real engine runs in tests/integration/test_vllm_partial_rollout.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from omegaconf import OmegaConf

from agentloop.errors import ConfigError, ServerError
from agentloop.servers.base import WeightLoader
from agentloop.servers.vllm import VLLMServer
from agentloop.types import StopReason

STEP = 0.01
"""Seconds per token of the fake engine."""


class FakeAsyncLLM:
    """The ``AsyncLLM`` calls VLLMServer makes: generate (FINAL_ONLY or DELTA outputs),
    pause_generation (abort / wait / keep), resume_generation, abort, reset_prefix_cache,
    collective_rpc and, with ``counts``, the output processor's per-request token counts.  The next
    token is the previous one + 1."""

    def __init__(self, counts: bool = True) -> None:
        self.model_config = SimpleNamespace(hf_config=SimpleNamespace(), is_multimodal_model=False)
        self.errored = False
        self.running: dict[str, list[int]] = {}
        self.aborted: set[str] = set()
        self.frozen = asyncio.Event()
        self.frozen.set()  # set: not frozen
        self.rpcs: list[str] = []
        self.calls: list[str] = []
        if counts:
            self.output_processor = SimpleNamespace(request_states={})

    async def generate(self, prompt: Any, params: Any, request_id: str, priority: int = 0) -> Any:
        ids: list[int] = []
        self.running[request_id] = ids
        states = getattr(
            self, "output_processor", SimpleNamespace(request_states={})
        ).request_states
        states[request_id] = SimpleNamespace(
            request_id=request_id, external_req_id=request_id,
            detokenizer=SimpleNamespace(num_output_tokens=lambda: len(ids)),
        )
        delta = params.output_kind.name == "DELTA"
        try:
            while len(ids) < params.max_tokens and request_id not in self.aborted:
                await self.frozen.wait()
                await asyncio.sleep(STEP)
                if request_id in self.aborted:
                    break
                ids.append(prompt["prompt_token_ids"][-1] + len(ids) + 1)
                if delta and len(ids) < params.max_tokens:
                    yield _out(ids[-1:], None, False)
            reason = "abort" if request_id in self.aborted else "length"
            if not delta:
                final = ids
            elif reason == "length":
                final = ids[-1:]
            else:
                final = []
            yield _out(final, reason, True)
        finally:
            self.running.pop(request_id, None)
            self.aborted.discard(request_id)
            states.pop(request_id, None)

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        self.calls.append(f"pause:{mode}")
        if mode == "abort":
            self.aborted.update(self.running)
        while mode == "wait" and self.running:
            await asyncio.sleep(STEP)
        self.frozen.clear()

    async def resume_generation(self) -> None:
        self.calls.append("resume")
        self.frozen.set()

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    async def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")

    async def collective_rpc(self, method: str, args: Any = (), kwargs: Any = None) -> None:
        self.rpcs.append(method)


def _out(ids: list[int], reason: str | None, finished: bool) -> Any:
    logprobs = [{t: SimpleNamespace(logprob=-0.5)} for t in ids]
    return SimpleNamespace(
        outputs=[SimpleNamespace(token_ids=list(ids), logprobs=logprobs, finish_reason=reason)],
        finished=finished, num_preemptions=0,
    )


def server(mode: str = "drain", counts: bool = True) -> tuple[VLLMServer, FakeAsyncLLM]:
    """A VLLMServer on the fake engine, as start() leaves it with the weight-sync extension
    loaded."""
    rollout = OmegaConf.create(
        {"prompt_length": 16, "response_length": 40, "server": {"weight_update": mode}}
    )
    s = VLLMServer.from_slices(rollout, OmegaConf.create({"path": "unused"}))
    s.engine = FakeAsyncLLM(counts)
    s.weights.transport = "direct"
    s.inflight.counts_tokens = counts
    return s, s.engine


PARAMS = {"logprobs": True, "max_tokens": 20}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_generation_carries_the_version_and_no_control_signals():
    async def main() -> None:
        s, _ = server()
        assert isinstance(s.weights, WeightLoader)
        out = await s.generate([1, 2, 3], PARAMS, "r")
        assert out.token_ids == list(range(4, 24)) and out.stop_reason == StopReason.LENGTH
        assert out.log_probs == [-0.5] * 20 and out.extra_fields == {
            "server_index": 0,
            "global_steps": 0,
        }
        assert not out.preempted_by_pause and not out.cut_by_update and out.max_tokens is None

    run(main())


@pytest.mark.parametrize("for_update", [False, True])
def test_a_pause_cuts_with_typed_signals_and_holds_new_requests(for_update: bool):
    async def main() -> None:
        s, engine = server()
        task = asyncio.ensure_future(s.generate([1], PARAMS, "cut"))
        await asyncio.sleep(STEP * 5)
        assert await s.pause(for_update=for_update) == 1 and s.gate.paused
        cut = await task
        held = asyncio.ensure_future(s.generate([1], {"max_tokens": 2}, "held"))
        await asyncio.sleep(STEP * 5)
        assert not held.done()
        await s.resume()
        after = await held
        assert cut.stop_reason == StopReason.ABORTED and 0 < len(cut.token_ids) < 20
        assert cut.preempted_by_pause and cut.cut_by_update is for_update and cut.max_tokens == 20
        assert "preempted_by_pause" not in cut.extra_fields
        assert after.token_ids == [2, 3] and not after.preempted_by_pause
        assert engine.calls == ["pause:abort", "resume"] and s.busy_seconds() > 0

    run(main())


def test_a_callers_own_abort_is_not_tagged():
    async def main() -> None:
        s, _ = server()
        task = asyncio.ensure_future(s.generate([1], PARAMS, "mine"))
        await asyncio.sleep(STEP * 5)
        await s.abort("mine")
        out = await task
        assert (
            out.stop_reason == StopReason.ABORTED
            and not out.preempted_by_pause
            and out.max_tokens is None
        )

    run(main())


def test_a_stream_cut_by_a_pause_ends_with_the_signals_on_its_last_chunk():
    async def main() -> list[Any]:
        s, _ = server()

        async def consume() -> list[Any]:
            return [d async for d in s.generate_stream([1], PARAMS, "stream")]

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(STEP * 5)
        await s.pause(for_update=True)
        chunks = await task
        await s.resume()
        return chunks

    chunks = run(main())
    last = chunks[-1]
    assert last.finished and last.stop_reason == StopReason.ABORTED
    assert last.preempted_by_pause and last.cut_by_update and last.max_tokens == 20
    assert not any(c.preempted_by_pause for c in chunks[:-1])


def test_generate_batch_streams_every_result_back():
    async def main() -> list[Any]:
        s, _ = server()
        requests = [
            {"prompt_ids": [i], "sampling_params": {"max_tokens": 2}, "request_id": f"b{i}"}
            for i in range(3)
        ]
        return [item async for group in s.generate_batch(requests) for item in group]

    got = sorted(run(main()), key=lambda x: x[0])
    assert [(i, out.token_ids) for i, out in got] == [(0, [1, 2]), (1, [2, 3]), (2, [3, 4])]


def test_a_drain_update_waits_for_the_running_request_and_publishes_the_version():
    async def main() -> None:
        s, engine = server("drain")
        task = asyncio.ensure_future(s.generate([1], PARAMS, "r"))
        await asyncio.sleep(STEP * 5)
        await s.begin_weight_update()
        assert task.done() and (await task).extra_fields["global_steps"] == 0
        await s.load_weight_bucket(_bucket())
        result = await s.finish_weight_update()
        assert result["version"] == 1 and result["transport"] == "direct" and result["tensors"] == 1
        assert s.global_steps == 1 and s.weights.open is None
        assert (
            engine.rpcs[0] == "agentloop_begin_weight_update"
            and engine.rpcs[-1] == "agentloop_finish_weight_update"
        )
        assert engine.calls == ["pause:wait", "reset_prefix_cache", "resume"]
        assert (await s.generate([1], {"max_tokens": 1}, "next")).extra_fields["global_steps"] == 1

    run(main())


@pytest.mark.parametrize("counts", [True, False])
def test_a_keep_update_lands_mid_generation_and_each_token_knows_its_version(counts: bool):
    async def main() -> None:
        s, engine = server("keep", counts=counts)
        assert s.keep_kv_on_update
        task = asyncio.ensure_future(s.generate([1], PARAMS, "r"))
        await asyncio.sleep(STEP * 6)
        await s.update_weights({"w": _tensor()}, global_steps=5)
        out = await task
        versions = out.extra_fields["weight_versions"]
        assert (
            out.token_ids == list(range(2, 22))
            and len(versions) == 20
            and versions == sorted(versions)
        )
        assert versions[0] == 0 and versions[-1] == 5
        assert (out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"]) == (
            0,
            5,
        )
        assert engine.calls == ["pause:keep", "resume"] and s.inflight.switches == {}

    run(main())


def test_weight_update_refusals_keep_their_messages():
    async def main() -> None:
        s, _ = server()
        with pytest.raises(ServerError, match="without an open weight update"):
            await s.finish_weight_update()
        await s.begin_weight_update(3)
        with pytest.raises(ServerError, match=r"already open; finish_weight_update\(\) it first"):
            await s.begin_weight_update()
        with pytest.raises(ServerError, match="cannot switch weight_update while requests run"):
            await s.set_weight_update("keep")
        await s.abort_weight_update()
        assert s.global_steps == 0 and s.weights.open is None
        await s.set_weight_update("keep")
        assert s.keep_kv_on_update
        with pytest.raises(ServerError, match="weight transport 'nope' is not available"):
            await s.begin_weight_update(transport="nope")

    run(main())
    stopped = VLLMServer.from_slices(OmegaConf.create({"prompt_length": 4, "response_length": 4}),
                                     OmegaConf.create({"path": "x"}))
    with pytest.raises(ServerError, match="is not started"):
        run(stopped.begin_weight_update())
    with pytest.raises(
        ConfigError,
        match=r"server.weight_update=\"x\" \(str\): expected " r"null, abort, drain or keep",
    ):
        VLLMServer.from_slices(
            OmegaConf.create(
                {"prompt_length": 4, "response_length": 4, "server": {"weight_update": "x"}}
            ),
            OmegaConf.create({"path": "x"}),
        )


def _tensor() -> Any:
    import torch

    return torch.zeros(2)


def _bucket() -> Any:
    from agentloop.servers.weight_sync import iter_buckets

    return next(iter(iter_buckets({"w": _tensor()}, bucket_bytes=1 << 20)))
