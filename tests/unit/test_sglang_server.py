"""The SGLang server actor against a contract fake of SGLang's Engine (SGLang itself needs a GPU).

The fake keeps to the parts of SGLang's API the server uses (``async_generate`` with ``input_ids`` /
``rid`` / ``return_logprob`` / ``stream`` / ``priority``, its output dicts, the tokenizer manager's
abort, memory, weight and cache calls) and refuses sampling keys SGLang does not know, so a wrong
mapping fails here.
"""

from __future__ import annotations

import asyncio
import importlib.util
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from agentloop.config import resolve_config
from agentloop.errors import ConfigError, ServerError
from agentloop.routing import AsyncLLMServerManager
from agentloop.servers.base import ServerDeadError, WeightLoader
from agentloop.servers.placement import ServerSlot, create_server_actor
from agentloop.servers.sglang import SGLangEngineAPI, SGLangServer, engine_kwargs
from agentloop.servers.weight_sync import iter_buckets
from agentloop.types import StopReason

SGLANG_SAMPLING_KEYS = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "stop", "stop_token_ids", "ignore_eos",
    "sampling_seed", "n",
}
EOS = 2


class FakeTokenizerManager:
    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.calls: list[Any] = []

    def abort_request(self, rid: str) -> None:  # synchronous in SGLang
        self.calls.append(("abort", rid))
        self.engine.aborted.add(rid)

    async def release_memory_occupation(self, obj: Any, request: Any) -> None:
        self.calls.append(("release", obj))

    async def resume_memory_occupation(self, obj: Any, request: Any) -> None:
        self.calls.append(("resume", obj))

    async def update_weights_from_tensor(self, obj: Any, request: Any) -> tuple[bool, str]:
        self.calls.append(("weights", obj))
        named = obj.kwargs["serialized_named_tensors"][0]
        self.engine.weights.update(dict(named))
        return True, "ok"

    async def flush_cache(self) -> None:
        self.calls.append(("flush", None))


class FakeEngine:
    """Replies ``reply_len`` tokens (last prompt id + 1, + 2, ...), one per ``token_delay`` seconds;
    a reply reaching ``EOS`` ends ``stop``; ``max_new_tokens`` ends it ``length``; an abort ends it
    ``abort`` with the tokens so far.  Streams cumulative chunks unless ``incremental``."""

    def __init__(self, reply_len: int = 5, token_delay: float = 0.0, incremental: bool = False,
                 memory_saver: bool = True) -> None:
        self.server_args = SimpleNamespace(incremental_streaming_output=incremental, tp_size=1,
                                           enable_memory_saver=memory_saver)
        self.tokenizer_manager = FakeTokenizerManager(self)
        self.reply_len, self.token_delay = reply_len, token_delay
        self.requests: list[dict[str, Any]] = []
        self.aborted: set[str] = set()
        self.weights: dict[str, Any] = {}
        self.children: list[int] = []

    def get_all_child_pids(self) -> list[int]:
        return self.children

    def shutdown(self) -> None:
        self.requests.append({"shutdown": True})

    async def async_generate(
        self, *, input_ids: list[int], sampling_params: dict[str, Any], rid: str,
        return_logprob: bool = False, stream: bool = False, priority: int | None = None,
        image_data: Any = None,
    ) -> Any:
        unknown = set(sampling_params) - SGLANG_SAMPLING_KEYS
        if unknown:
            raise TypeError(f"SamplingParams got unexpected keys {unknown}")
        self.requests.append(
            {
                "input_ids": input_ids, "sampling_params": sampling_params, "rid": rid,
                "return_logprob": return_logprob, "stream": stream, "priority": priority,
            }
        )
        # a whole reply is always whole
        incremental = stream and self.server_args.incremental_streaming_output
        chunks = self._run(input_ids, sampling_params, rid, return_logprob, incremental)
        if stream:
            return chunks
        return [chunk async for chunk in chunks][-1]

    async def _run(
        self, input_ids: list[int], sp: dict[str, Any], rid: str, logprob: bool, incremental: bool
    ) -> Any:
        ids: list[int] = []
        finish = None
        while finish is None:
            if self.token_delay:
                await asyncio.sleep(self.token_delay)
            if rid in self.aborted:
                finish = "abort"
                break
            ids.append(input_ids[-1] + len(ids) + 1)
            if not sp.get("ignore_eos") and (ids[-1] == EOS or len(ids) >= self.reply_len):
                finish = "stop"
            elif len(ids) >= sp["max_new_tokens"]:
                finish = "length"
            out = ids[-1:] if incremental else ids
            if finish is None:
                yield self._chunk(out, None, logprob, len(ids) - len(out))
        self.aborted.discard(rid)
        if not incremental:
            out = ids
        elif finish == "abort":
            out = []
        else:
            out = ids[-1:]
        yield self._chunk(out, finish, logprob, len(ids) - len(out))

    @staticmethod
    def _chunk(ids: list[int], finish: str | None, logprob: bool, offset: int) -> dict[str, Any]:
        meta: dict[str, Any] = {"finish_reason": {"type": finish} if finish else None}
        if logprob:
            meta["output_token_logprobs"] = [
                (-0.1 * (offset + i + 1), t, None) for i, t in enumerate(ids)
            ]
        return {"output_ids": list(ids), "meta_info": meta}


def _request(kind: str) -> Any:
    return lambda **kw: SimpleNamespace(type=kind, kwargs=kw)


IO = SimpleNamespace(**{kind: _request(kind) for kind in ("ReleaseMemoryOccupationReqInput",
                                                          "ResumeMemoryOccupationReqInput",
                                                          "UpdateWeightsFromTensorReqInput")})


class PassThrough:
    @staticmethod
    def serialize(named: Any) -> Any:
        return named


def rollout(**over: Any) -> Any:
    base = {
        "prompt_length": 64, "response_length": 16, "dtype": "bfloat16",
        "tensor_model_parallel_size": 1, "gpu_memory_utilization": 0.5, "max_num_seqs": 32,
        "max_num_batched_tokens": 4096, "enable_prefix_caching": True, "free_cache_engine": True,
        "seed": 0, "load_format": "auto", "server": {"priority": None},
        "engine_kwargs": {"sglang": {}},
    }
    return OmegaConf.create({**base, **over})


async def started(engine: FakeEngine) -> SGLangServer:
    server = SGLangServer.from_slices(rollout(), OmegaConf.create({"path": "/m"}), server_index=3)
    await server.start(SGLangEngineAPI(engine, IO, PassThrough))
    return server


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_generate_maps_verl_keys_and_keeps_stop_and_length_apart() -> None:
    async def go() -> None:
        engine = FakeEngine(reply_len=5)
        server = await started(engine)
        out = await server.generate(
            [7, 8], {"max_tokens": 3, "temperature": 0.5, "seed": 9, "logprobs": True, "top_k": 0},
            "r1",
        )
        assert out.token_ids == [9, 10, 11] and out.stop_reason == StopReason.LENGTH
        assert out.log_probs == pytest.approx([-0.1, -0.2, -0.3])
        assert out.extra_fields == {"server_index": 3, "global_steps": 0}
        sent = engine.requests[-1]
        assert sent["rid"] == "r1" and sent["return_logprob"] and sent["input_ids"] == [7, 8]
        assert sent["sampling_params"] == {
            "max_new_tokens": 3, "temperature": 0.5, "sampling_seed": 9, "top_k": -1,
        }
        stop = await server.generate([20], {"max_tokens": 10}, "r2")
        assert stop.token_ids == [21, 22, 23, 24, 25] and stop.stop_reason == StopReason.STOP
        assert stop.log_probs is None
        # past prompt + response length
        full = await server.generate(list(range(80)), {"max_tokens": 5}, "r3")
        assert (
            full.token_ids == []
            and full.stop_reason == StopReason.LENGTH
            and len(engine.requests) == 2
        )

    run(go())


@pytest.mark.parametrize("incremental", [False, True])
def test_the_stream_joins_to_the_generate_output(incremental: bool) -> None:
    async def go() -> None:
        server = await started(FakeEngine(reply_len=4, incremental=incremental))
        whole = await server.generate([3], {"max_tokens": 8, "logprobs": True}, "a")
        chunks = [
            d async for d in server.generate_stream([3], {"max_tokens": 8, "logprobs": True}, "b")
        ]
        assert [t for c in chunks for t in c.token_ids] == whole.token_ids
        assert [x for c in chunks for x in c.log_probs or []] == pytest.approx(whole.log_probs)
        assert (
            chunks[-1].finished and chunks[-1].stop_reason == whole.stop_reason == StopReason.STOP
        )
        assert not any(c.finished for c in chunks[:-1])

    run(go())


def test_abort_returns_the_tokens_so_far_and_pause_tags_them_for_the_router() -> None:
    async def go() -> None:
        engine = FakeEngine(reply_len=50, token_delay=0.01)
        server = await started(engine)
        task = asyncio.ensure_future(server.generate([10], {"max_tokens": 40}, "x"))
        await asyncio.sleep(0.05)
        await server.abort("x")
        out = await task
        assert out.stop_reason == StopReason.ABORTED and 0 < len(out.token_ids) < 40
        assert not out.preempted_by_pause  # the caller's own abort is never resumed

        task = asyncio.ensure_future(server.generate([10], {"max_tokens": 40}, "y"))
        await asyncio.sleep(0.05)
        assert await server.pause() == 1
        cut = await task
        assert cut.stop_reason == StopReason.ABORTED and cut.preempted_by_pause
        assert cut.max_tokens == 40  # the limit it ran under, for the router to resume it
        held = asyncio.ensure_future(server.generate([10], {"max_tokens": 2}, "z"))
        await asyncio.sleep(0.05)
        assert not held.done()  # new requests wait while paused
        await server.resume()
        assert (await held).token_ids == [11, 12]

    run(go())


def test_partial_rollout_through_the_router_joins_the_pieces() -> None:
    async def go() -> None:
        server = await started(FakeEngine(reply_len=100, token_delay=0.005))
        router = AsyncLLMServerManager([server], partial_rollout=True)
        task = asyncio.ensure_future(
            router.generate(
                "p", prompt_ids=[10], sampling_params={"max_tokens": 12, "ignore_eos": True}
            )
        )
        await asyncio.sleep(0.03)
        await server.pause()
        await server.resume()
        out = await task
        assert (
            len(out.token_ids) == 12
            and out.stop_reason == StopReason.LENGTH
            and out.num_preempted == 1
        )

    run(go())


def test_a_weight_update_waits_for_running_requests_and_holds_new_ones() -> None:
    async def go() -> None:
        engine = FakeEngine(reply_len=10, token_delay=0.01)
        server = await started(engine)
        assert isinstance(server.weights, WeightLoader)
        running = asyncio.ensure_future(server.generate([10], {"max_tokens": 10}, "old"))
        await asyncio.sleep(0.02)
        update = asyncio.ensure_future(server.update_weights({"w": torch.ones(2)}))
        await asyncio.sleep(0.02)
        late = asyncio.ensure_future(server.generate([10], {"max_tokens": 2}, "new"))
        first = await running
        assert first.stop_reason == StopReason.STOP and first.extra_fields["global_steps"] == 0
        info = await update
        assert info["version"] == 1 and info["tensors"] == 1
        assert torch.equal(engine.weights["w"], torch.ones(2))
        kinds = [c[0] for c in engine.tokenizer_manager.calls]
        assert kinds == ["weights", "flush"]  # loaded, then the radix cache flushed
        assert (await late).extra_fields["global_steps"] == 1  # it waited for the new weights
        with pytest.raises(ServerError, match="without an open weight update"):
            await server.finish_weight_update()

    run(go())


def test_sleep_and_wake_up_release_and_resume_memory_only_with_the_memory_saver() -> None:
    async def go() -> None:
        engine = FakeEngine()
        server = await started(engine)
        assert server.supports_sleep
        await server.sleep()
        await server.sleep()
        await server.wake_up()
        assert [c[0] for c in engine.tokenizer_manager.calls] == ["flush", "release", "resume"]
        plain = await started(FakeEngine(memory_saver=False))
        await plain.sleep()
        assert not plain.supports_sleep

    run(go())


def test_a_dead_engine_process_is_a_server_dead_error() -> None:
    async def go() -> None:
        engine = FakeEngine()
        server = await started(engine)
        assert (await server.check_health())["server_index"] == 3
        engine.children = [2 ** 22 + 12345]  # no such process
        with pytest.raises(ServerDeadError):
            await server.check_health()

    run(go())


def test_a_weight_update_on_a_dead_engine_is_a_server_dead_error_the_manager_routes_around() -> (
    None
):
    async def go() -> None:
        engine = FakeEngine()
        server = await started(engine)
        await server.begin_weight_update(1)

        async def died(tensors: Any) -> None:
            engine.children = [2 ** 22 + 12345]  # the engine dies while loading (no such process)
            raise RuntimeError("connection reset")

        server.api.load_tensors = died
        with pytest.raises(ServerDeadError, match="update goes on without this server"):
            await server.load_weight_bucket(
                next(iter_buckets({"w": torch.ones(2)}, bucket_bytes=1 << 20))
            )
        with pytest.raises(ServerDeadError):  # and the next update does not even open
            await server.begin_weight_update(2)
        assert server.global_steps == 0

    run(go())


def test_server_wide_calls_on_a_dead_engine_are_server_dead_errors_not_hangs() -> None:
    """pause / sleep / wake_up / clear_kv_cache on an engine whose processes died raise
    ServerDeadError at once (the manager then goes on without the server and restarts it) instead of
    waiting on a dead scheduler."""
    async def go() -> None:
        async def never() -> None:  # a call to a dead scheduler is never answered
            await asyncio.sleep(3600)

        asleep, awake = FakeEngine(), FakeEngine()
        servers = [await started(asleep), await started(awake)]
        await servers[0].sleep()
        for engine, server in zip((asleep, awake), servers, strict=True):
            engine.children = [2 ** 22 + 12345]  # no such process
            server.api.resume_memory = server.api.flush_cache = server.api.release_memory = never
        calls = [servers[0].wake_up, servers[1].sleep, servers[1].clear_kv_cache, servers[1].pause]
        for call in calls:
            with pytest.raises(ServerDeadError, match="goes on without this server"):
                await asyncio.wait_for(call(), 5)
        assert not servers[1].gate.paused  # a refused pause holds nothing

    run(go())


def test_engine_kwargs_follow_verl_keys_and_engine_kwargs_sglang_wins() -> None:
    kw = engine_kwargs(
        rollout(
            server={"priority": "context"},
            engine_kwargs={"sglang": {"attention_backend": "fa3", "mem_fraction_static": 0.3}},
        ),
        OmegaConf.create({"path": "~/m", "tokenizer_path": None}),
        server_index=2,
    )
    assert kw["model_path"].endswith("/m") and "~" not in kw["model_path"]
    assert (
        kw["skip_tokenizer_init"]
        and kw["context_length"] == 80
        and kw["max_running_requests"] == 32
    )
    assert kw["random_seed"] == 2 and kw["enable_memory_saver"] and not kw["disable_radix_cache"]
    assert (
        kw["enable_priority_scheduling"]
        and kw["attention_backend"] == "fa3"
        and kw["mem_fraction_static"] == 0.3
    )


@pytest.mark.skipif(
    importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here"
)
def test_rollout_name_sglang_without_sglang_says_how_to_install_it(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    cfg = resolve_config(
        {
            "actor_rollout_ref": {"model": {"path": str(tmp_path)}, "rollout": {"name": "sglang"}},
            "data": {},
        }
    )
    slot = ServerSlot(scheduling_strategy=None)
    # the server class is chosen before any actor is created: no Ray needed to see the errors
    with pytest.raises(
        ConfigError,
        match=r"name=sglang but SGLang is not installed.*pip " r"install -e '.\[sglang\]'",
    ):
        create_server_actor(cfg, slot, 0)
    # a config the config check would refuse
    unchecked = SimpleNamespace(engine=SimpleNamespace(name="trtllm"))
    with pytest.raises(ConfigError, match="use 'vllm' or 'sglang'"):
        create_server_actor(unchecked, slot, 0)
