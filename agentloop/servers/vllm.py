"""vLLM server: hosts ``vllm.v1.engine.async_llm.AsyncLLM`` inside one (Ray actor) process, token
in, token out.

Sampling and engine keys, weight updates and pause: docs/concepts.md ("The vLLM server", "Weight
sync", "Pause, resume and partial rollouts").  The server is built from parts (see
:class:`VLLMServer`); its actor methods are the :class:`agentloop.servers.base.LLMServer` protocol.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from agentloop.batch.multimodal import engine_prompt
from agentloop.cluster.enginewatch import EngineWatch, engine_progress, kill_engine_processes
from agentloop.config import EngineConfig, ModelConfig, ServerConfig, ServerSections
from agentloop.errors import ServerError
from agentloop.servers.base import (
    GOES_ON_WITHOUT,
    GenerateBatcher,
    PauseGate,
    ServerDeadError,
    load_whole,
)
from agentloop.servers.inflight_update import InFlightUpdate, collect_stream
from agentloop.servers.vllm_plugin import engine_arg_defaults
from agentloop.servers.vllm_weights import VLLMWeights
from agentloop.servers.weight_sync import WORKER_EXTENSION, WeightBucket, Weights
from agentloop.types import StopReason, TokenDelta, TokenOutput
from agentloop.utils.gcheap import freeze_startup_heap
from agentloop.utils.process import restore_normal_priority

logger = logging.getLogger(__name__)

_SAMPLING_KEYS = (
    "temperature", "top_p", "top_k", "repetition_penalty", "seed", "stop_token_ids", "ignore_eos",
)
_FINISH_TO_STOP = {
    "stop": StopReason.STOP, "length": StopReason.LENGTH, "abort": StopReason.ABORTED,
}


def engine_args(engine: EngineConfig, server: ServerConfig, model: ModelConfig, on_cpu: bool,
                server_index: int = 0) -> dict[str, Any]:
    """vLLM ``AsyncEngineArgs`` from the typed config (verl's key names; ``engine_kwargs.vllm``
    last, so it overrides anything).  Each server is seeded ``seed + server_index``, as verl seeds
    its replicas, so servers given the same requests do not sample the same tokens."""
    args: dict[str, Any] = {
        "model": model.local_path,
        "trust_remote_code": model.trust_remote_code,
        "load_format": engine.load_format,
        "logprobs_mode": engine.logprobs_mode,
        "scheduling_policy": engine.scheduling_policy,
        "dtype": engine.dtype,
        "max_model_len": engine.context_length,
        "max_num_seqs": engine.max_num_seqs,
        "max_num_batched_tokens": max(engine.max_num_batched_tokens, engine.context_length),
        "enable_prefix_caching": engine.enable_prefix_caching,
        "enforce_eager": engine.enforce_eager,
        "seed": engine.seed + int(server_index),
        "disable_log_stats": engine.disable_log_stats,
        "tensor_parallel_size": engine.tensor_model_parallel_size,
        # On CPU this is the fraction of the NUMA node's memory that must be free at start-up
        # (vLLM's
        # default 0.92 fails as soon as the page cache holds a GiB); the KV cache itself is sized by
        # VLLM_CPU_KVCACHE_SPACE.
        "gpu_memory_utilization": engine.gpu_memory_utilization,
    }
    if model.local_tokenizer_path:
        args["tokenizer"] = model.local_tokenizer_path
    if on_cpu:
        args["distributed_executor_backend"] = "uni" if args["tensor_parallel_size"] == 1 else "mp"
    else:
        args["enable_sleep_mode"] = engine.free_cache_engine
        args["enable_chunked_prefill"] = engine.enable_chunked_prefill
        if engine.cudagraph_capture_sizes:
            args["cudagraph_capture_sizes"] = list(engine.cudagraph_capture_sizes)
    if server.priority not in (None, "", "fcfs"):  # the router sends priorities
        args["scheduling_policy"] = "priority"
    args["worker_extension_cls"] = WORKER_EXTENSION  # weight updates without files (weight_sync.py)
    # Qwen2-VL without torchvision: no videos (vllm_plugin.py)
    args.update(engine_arg_defaults(args["model"]))
    args.update(dict(engine.engine_kwargs.get("vllm") or {}))
    return args


def _stop_sequence(completion: Any) -> str | None:
    """The stop string that ended a completion: vLLM reports it as ``stop_reason`` (a token id there
    is an end-of-turn / stop token, not a stop string)."""
    reason = getattr(completion, "stop_reason", None)
    return reason if isinstance(reason, str) and completion.finish_reason == "stop" else None


async def _empty() -> AsyncIterator[Any]:
    return
    yield


def _sampled_logprobs(completion: Any, token_ids: list[int]) -> list[float]:
    """The logprob of each sampled token (vLLM returns a {token: Logprob} dict per position)."""
    return [
        float(lp[t].logprob) for lp, t in zip(completion.logprobs or [], token_ids, strict=False)
    ]


class VLLMServer:
    """One vLLM AsyncLLM engine.  Build with :meth:`start` (async) before use.

    Parts: ``gate`` (:class:`~agentloop.servers.base.PauseGate`: pause / resume), ``batcher``
    (:class:`~agentloop.servers.base.GenerateBatcher`: ``generate_batch``), ``inflight``
    (:class:`~agentloop.servers.inflight_update.InFlightUpdate`: ``server.weight_update`` and
    keep-mode token versions), ``weights`` (:class:`~agentloop.servers.vllm_weights.VLLMWeights`:
    weight updates, the served version) and ``watch``
    (:class:`~agentloop.cluster.enginewatch.EngineWatch`: a dead or hung engine).

    Args:
        sections: the typed engine, server and model sections (``ServerSections.of(cfg)``).
        server_index: rank of this server among all servers (for logs and seeds).
    """

    supports_sleep: bool = False

    def __init__(self, sections: ServerSections, server_index: int = 0) -> None:
        self.server_index = server_index
        self.engine_cfg = sections.engine
        self.server_cfg = sections.server
        self.model_cfg = sections.model_config
        self.prompt_length = self.engine_cfg.prompt_length
        self.response_length = self.engine_cfg.response_length
        self.engine: Any = None
        self._sleeping = False
        self.gate = PauseGate()
        self.batcher = GenerateBatcher(self.generate)
        self.inflight = InFlightUpdate(self.server_cfg.weight_update, server_index)
        self.weights = VLLMWeights(server_index, lambda: self.engine, self.gate, self.inflight,
                                   engine_dead=self._engine_dead, raise_if_dead=self._raise_if_dead)
        # requests of an engine that died or hung are failed over (enginewatch.py)
        self.watch = EngineWatch(
            self._engine_dead, progress=lambda: engine_progress(self.engine),
            stall_timeout=self.server_cfg.stall_timeout,
            holding=lambda: self.weights.open is not None or self.gate.paused or self._sleeping,
            on_stall=lambda why: kill_engine_processes())

    @classmethod
    def from_slices(cls, rollout: Any, model: Any, server_index: int = 0) -> VLLMServer:
        """A server from the ``rollout`` and ``model`` config slices
        (:meth:`ServerSections.from_slices`)."""
        return cls(ServerSections.from_slices(rollout, model), server_index)

    @property
    def global_steps(self) -> int:
        """Version of the weights being served (verl's name; 0 before any update):
        ``weights.version``."""
        return self.weights.version

    @property
    def weight_transport(self) -> str:
        """``direct`` (tensors into the engine worker's memory) or ``file`` (the fallback); set
        by start()."""
        return self.weights.transport

    @property
    def keep_kv_on_update(self) -> bool:
        """``server.weight_update: keep`` (see
        :class:`~agentloop.servers.inflight_update.InFlightUpdate`)."""
        return self.inflight.keep

    async def start(self) -> dict[str, Any]:
        """Create the engine; returns facts about it (platform, start seconds)."""
        t0 = time.perf_counter()
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # vLLM is imported only where an engine runs (slow to import; it picks its platform on
        # import)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        on_cpu = current_platform.is_cpu()
        args = engine_args(
            self.engine_cfg, self.server_cfg, self.model_cfg, on_cpu, self.server_index
        )
        # before the engine's processes exist: they inherit it
        priority = restore_normal_priority(self.engine_cfg.normal_priority)
        try:
            self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        except Exception as e:
            raise ServerError(
                f"vLLM server {self.server_index} failed to start with {args}: {e}"
            ) from e
        self.supports_sleep = bool(args.get("enable_sleep_mode", False))
        self.weights.transport = (
            "direct" if args.get("worker_extension_cls") == WORKER_EXTENSION else "file"
        )
        hf_config = self.engine.model_config.hf_config
        self.weights.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.inflight.counts_tokens = hasattr(
            getattr(self.engine, "output_processor", None), "request_states"
        )
        self.watch.start()
        # the actor's start-up objects stay out of full collections
        frozen = freeze_startup_heap(self.engine_cfg)
        return {
            "platform": "cpu" if on_cpu else "cuda", "start_s": time.perf_counter() - t0,
            "pid": os.getpid(), "priority": priority, "weight_transport": self.weight_transport,
            "gc_frozen": frozen,
        }

    def _sampling_params(
        self, prompt_len: int, params: dict[str, Any], stream: bool = False
    ) -> Any:
        # vLLM is imported only where an engine runs (after start(): already loaded, the import is a
        # lookup)
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        budget = self.prompt_length + self.response_length - prompt_len
        max_tokens = params.get("max_tokens") or min(self.response_length, budget)
        kwargs = {k: params[k] for k in _SAMPLING_KEYS if params.get(k) is not None}
        if params.get("logprobs"):
            kwargs["logprobs"] = 0
        if params.get("stop"):  # stop strings need the engine to detokenize
            kwargs["stop"] = params["stop"]
        # a grammar (gateway/constraints.py): vLLM's own field names
        if params.get("structured_outputs"):
            kwargs["structured_outputs"] = StructuredOutputsParams(**params["structured_outputs"])
        return SamplingParams(
            max_tokens=int(min(max_tokens, budget)), detokenize=bool(params.get("stop")),
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            **kwargs,
        )

    def _prompt(
        self, prompt_ids: list[int], image_data: list[Any] | None,
        video_data: list[Any] | None = None,
    ) -> Any:
        # media refused if text-only
        return engine_prompt(prompt_ids, image_data, video_data, self.engine.model_config)

    async def generate(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
        image_data: list[Any] | None = None, video_data: list[Any] | None = None,
    ) -> TokenOutput:
        """Generate from token ids; see the module docstring for the keys.  While the server is
        paused the call waits for :meth:`resume`; a pause during the call ends it with the tokens
        sampled so far (aborted)."""
        self._require_started()
        want_logprobs = bool(sampling_params.get("logprobs"))
        params = self._sampling_params(len(prompt_ids), sampling_params)
        if params.max_tokens <= 0:
            return TokenOutput(token_ids=[], log_probs=[] if want_logprobs else None,
                               stop_reason=StopReason.LENGTH, extra_fields=self._extra_fields())
        # keep mode without token counts at a switch: follow the tokens
        if self.inflight.follows_stream():
            deltas = self.generate_stream(
                prompt_ids, sampling_params, request_id, image_data, video_data
            )
            return await collect_stream(deltas, want_logprobs)
        final, prompt = None, self._prompt(prompt_ids, image_data, video_data)
        started_at = self.global_steps
        async with self.gate.admitted(request_id) as admitted:
            if admitted:
                with self.watch.request():
                    try:
                        async for out in self.engine.generate(
                            prompt, params, request_id,
                            priority=int(sampling_params.get("priority") or 0),
                        ):
                            final = out
                    except BaseException as e:
                        if isinstance(e, Exception) or self.watch.cut_by_death(e):
                            self._raise_if_dead(e)
                        raise
            output = (
                self._to_token_output(final, want_logprobs)
                if final is not None
                else TokenOutput(
                    token_ids=[], log_probs=[] if want_logprobs else None,
                    stop_reason=StopReason.ABORTED, extra_fields=self._extra_fields(),
                )
            )
            extra = output.extra_fields
            if self.inflight.keep:
                versions = self.inflight.token_versions(
                    request_id, started_at, len(output.token_ids)
                )
                extra = self.inflight.versioned(extra, versions)
            signals = self.gate.signals(output.stop_reason, request_id, params.max_tokens)
            return output.model_copy(update={"extra_fields": extra, **signals})

    async def generate_batch(
        self, requests: list[dict[str, Any]]
    ) -> AsyncIterator[list[tuple[int, Any]]]:
        """Many :meth:`generate` calls in one, results in groups as they finish (see
        :class:`~agentloop.servers.base.GenerateBatcher`)."""
        async for group in self.batcher.run(requests):
            yield group

    async def generate_stream(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
        image_data: list[Any] | None = None, video_data: list[Any] | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """Like :meth:`generate`, but yields the ids as the engine samples them (the last chunk has
        ``finished=True`` and the stop reason); the ids joined equal what :meth:`generate` returns.
        """
        self._require_started()
        want_logprobs = bool(sampling_params.get("logprobs"))
        params = self._sampling_params(len(prompt_ids), sampling_params, stream=True)
        if params.max_tokens <= 0:
            yield TokenDelta(token_ids=[], log_probs=[] if want_logprobs else None, finished=True,
                             stop_reason=StopReason.LENGTH, extra_fields=self._extra_fields())
            return
        finished = False
        # the weights each token was sampled with (a keep-mode update may land between)
        versions: list[int] = []
        async with self.gate.admitted(request_id) as admitted:
            with self.watch.request():  # its task is failed over if the engine dies meanwhile
                try:
                    prompt = self._prompt(prompt_ids, image_data, video_data)
                    rank = int(sampling_params.get("priority") or 0)
                    async for out in (
                        self.engine.generate(prompt, params, request_id, priority=rank)
                        if admitted
                        else _empty()
                    ):
                        completion = out.outputs[0]
                        ids = list(completion.token_ids)
                        log_probs = _sampled_logprobs(completion, ids) if want_logprobs else None
                        finished = bool(out.finished)
                        reason = completion.finish_reason or "abort"
                        stop = _FINISH_TO_STOP.get(reason, StopReason.STOP) if finished else None
                        versions += [self.global_steps] * len(ids)
                        extra = (
                            self.inflight.versioned(self._extra_fields(), versions)
                            if finished
                            else {}
                        )
                        yield TokenDelta(
                            token_ids=ids, log_probs=log_probs, finished=finished, stop_reason=stop,
                            stop_sequence=_stop_sequence(completion) if finished else None,
                            extra_fields=extra,
                            **self.gate.signals(stop, request_id, params.max_tokens),
                        )
                except BaseException as e:
                    if isinstance(e, Exception) or self.watch.cut_by_death(e):
                        self._raise_if_dead(e)
                    raise
                self.inflight.forget(request_id)  # streams tag their tokens as they come
                if not finished:
                    yield TokenDelta(
                        token_ids=[], log_probs=[] if want_logprobs else None, finished=True,
                        stop_reason=StopReason.ABORTED,
                        extra_fields=self.inflight.versioned(self._extra_fields(), versions),
                        **self.gate.signals(StopReason.ABORTED, request_id, params.max_tokens),
                    )

    async def pause(self, for_update: bool = False) -> int:
        """Abort every in-flight request and hold new ones until :meth:`resume` (see
        :meth:`agentloop.servers.base.LLMServer.pause`); the KV cache is kept."""
        self._require_started()
        if self.gate.paused:
            return 0
        n = self.gate.close(for_update)
        # The engine's own pause aborts what runs (their final outputs carry the tokens so far) and
        # queues any
        # request already past the gate but not yet in the engine, so nothing runs until resume().
        try:
            await self._engine_call(
                self.engine.pause_generation(mode="abort", clear_cache=False), "pause"
            )
        except ServerDeadError:
            self.gate.open()  # nothing is held on a dead engine: its requests fail over
            raise
        return n

    async def resume(self) -> None:
        """Let held and new requests run again (no-op when not paused); during an open weight update
        they run once :meth:`finish_weight_update` has applied it."""
        if not self.gate.paused:
            return
        if self.weights.open is None and self.engine is not None:
            try:
                await self._engine_call(self.engine.resume_generation(), "resume")
            except ServerDeadError:
                self.gate.open()  # the held requests go on, find the engine dead and fail over
                raise
        self.gate.open()

    def busy_seconds(self) -> float:
        """Seconds with at least one request in the engine (:meth:`PauseGate.busy_seconds`)."""
        return self.gate.busy_seconds()

    def _require_started(self) -> None:
        if self.engine is None:
            raise ServerError(f"vLLM server {self.server_index} is not started; call start() first")

    def _raise_if_dead(
        self, error: BaseException,
        then: str = "the request is retried on another server and this one restarted",
    ) -> None:
        """An engine whose core process died raises vLLM's EngineDeadError for this and every later
        request: turn it into :class:`ServerDeadError` so the router fails over (or a weight update
        goes on without this server) and the manager restarts it."""
        if self._engine_dead() or type(error).__name__ == "EngineDeadError":
            cause = (
                ""
                if isinstance(error, asyncio.CancelledError)
                else f" ({type(error).__name__}: {error})"
            )
            raise ServerDeadError(
                f"vLLM server {self.server_index}: {self._death()}{cause}; {then}",
                self.server_index,
            ) from error

    async def _engine_call(self, call: Awaitable[Any], what: str) -> Any:
        """Await an engine call of a server-wide operation; a dead engine's error becomes
        ServerDeadError, so the manager goes on without this server and restarts it
        (supervisor.settle) instead of failing its caller."""
        try:
            return await call
        except Exception as e:
            self._raise_if_dead(e, then=GOES_ON_WITHOUT.format(what))
            raise

    def _engine_dead(self) -> bool:
        return self.watch.stalled is not None or bool(
            self.engine is not None and getattr(self.engine, "errored", False)
        )

    def _death(self) -> str:
        return self.watch.stalled or "the engine process died"

    async def check_health(self) -> dict[str, Any]:
        """Raises :class:`ServerDeadError` when the engine died; else returns the server's facts."""
        self._require_started()
        if self._engine_dead():
            raise ServerDeadError(
                f"vLLM server {self.server_index}: {self._death()}", self.server_index
            )
        await self.engine.check_health()
        return {
            "server_index": self.server_index, "global_steps": self.global_steps,
            "pid": os.getpid(),
        }

    def _to_token_output(self, final: Any, want_logprobs: bool) -> TokenOutput:
        completion = final.outputs[0]
        token_ids = list(completion.token_ids)
        log_probs = _sampled_logprobs(completion, token_ids) if want_logprobs else None
        preempted = getattr(final, "num_preemptions", None)
        return TokenOutput(
            token_ids=token_ids, log_probs=log_probs,
            stop_reason=_FINISH_TO_STOP.get(completion.finish_reason or "abort", StopReason.STOP),
            stop_sequence=_stop_sequence(completion),
            num_preempted=int(preempted) if preempted is not None else -1,
            extra_fields=self._extra_fields(),
        )

    def _extra_fields(self) -> dict[str, Any]:
        """What every output carries: this server's index and the version of the weights that
        produced it."""
        return {"server_index": self.server_index, "global_steps": self.global_steps}

    async def abort(self, request_id: str) -> None:
        """Abort an in-flight request (its generate returns ``stop_reason='aborted'``); a request
        held by a pause ends aborted without running.  A caller's abort is never resumed by the
        router."""
        self.gate.caller_abort(request_id)
        await self.engine.abort(request_id)

    async def wake_up(self) -> None:
        """Re-acquire weights and KV cache (no-op, logged, where the engine cannot sleep)."""
        if not self.supports_sleep:
            logger.info(
                "server %d: wake_up is a no-op (sleep mode unsupported on this platform)",
                self.server_index,
            )
            return
        if self._sleeping:
            await self._engine_call(self.engine.wake_up(), "wake_up")
            self._sleeping = False

    async def sleep(self) -> None:
        """Free weights and KV cache between rollouts (no-op, logged, where unsupported, e.g.
        CPU)."""
        if not self.supports_sleep:
            logger.info(
                "server %d: sleep is a no-op (sleep mode unsupported on this platform)",
                self.server_index,
            )
            return
        await self._engine_call(self.engine.reset_prefix_cache(), "sleep")
        await self._engine_call(self.engine.sleep(level=1), "sleep")
        self._sleeping = True

    async def set_global_steps(self, global_steps: int) -> None:
        """Set the weight version reported in ``extra_fields["global_steps"]`` without loading
        weights (verl's server method of the same name)."""
        self.weights.version = int(global_steps)

    async def set_weight_update(self, mode: str) -> None:
        """Switch ``server.weight_update`` (``abort`` | ``drain`` | ``keep``) for later requests and
        updates; refused while a request runs or an update is open
        (:meth:`InFlightUpdate.set_mode`)."""
        self.inflight.set_mode(
            mode, busy=self.weights.open is not None or bool(self.gate.in_flight)
        )

    async def begin_weight_update(
        self, global_steps: int | None = None, *, transport: str = "auto"
    ) -> None:
        """Open a weight update: in-flight requests finish on the old weights (keep mode: are frozen
        and go on after it), new ones wait until :meth:`finish_weight_update`.  ``global_steps``
        becomes the served version at the end (default: the current one + 1); ``transport`` is
        ``auto`` (this server's :attr:`weight_transport`), ``direct`` or ``file``."""
        self._require_awake()
        await self.weights.begin(global_steps, transport)

    async def load_weight_bucket(self, bucket: WeightBucket) -> None:
        """Load one bucket of the open update (HF names; any order; a layer may straddle
        buckets)."""
        await self.weights.load(bucket)

    async def finish_weight_update(self) -> dict[str, Any]:
        """Apply the update, reset the prefix cache, publish the new version and resume generation.
        Returns what was loaded: version, transport, tensors, bytes, seconds."""
        return await self.weights.finish()

    async def abort_weight_update(self) -> None:
        """Close an open weight update without publishing its version and resume generation (a no-op
        when none is open).  Layers that got all their tensors keep the new values: run the update
        again.
        """
        await self.weights.abort()

    async def update_weights(self, named_tensors: Weights, global_steps: int | None = None, *,
                             transport: str = "auto") -> dict[str, Any]:
        """The whole update in one call (one bucket): begin, load, finish.  With tied embeddings and
        no ``lm_head.weight`` given, the output layer is loaded from ``model.embed_tokens.weight``.
        """
        self._require_awake()
        return await load_whole(self.weights, named_tensors, global_steps, transport)

    def _require_awake(self) -> None:
        self._require_started()
        if self._sleeping:
            raise ServerError(
                f"vLLM server {self.server_index} is asleep: wake_up() before updating weights"
            )

    async def clear_kv_cache(self) -> None:
        """Drop the prefix (KV) cache, e.g. after a weight update made it stale."""
        await self._engine_call(self.engine.reset_prefix_cache(), "clear_kv_cache")

    async def start_profile(self, **kwargs: Any) -> None:
        """Start vLLM's torch profiler (it needs ``VLLM_TORCH_PROFILER_DIR`` set for the server; a
        logged no-op otherwise, as on engines without a profiler)."""
        if not os.environ.get("VLLM_TORCH_PROFILER_DIR"):
            logger.warning(
                "server %d: start_profile is a no-op: set "
                "VLLM_TORCH_PROFILER_DIR (in the Ray runtime "
                "env) to profile the engine",
                self.server_index,
            )
            return
        await self.engine.start_profile()
        self._profiling = True

    async def stop_profile(self) -> None:
        """Stop the profiler and write its trace (no-op when none was started)."""
        if getattr(self, "_profiling", False):
            await self.engine.stop_profile()
            self._profiling = False

    async def shutdown(self) -> None:
        """Stop the engine and its processes."""
        self.watch.stop()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
