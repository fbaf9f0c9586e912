"""vLLM server: hosts ``vllm.v1.engine.async_llm.AsyncLLM`` inside one (Ray actor) process, token
in, token out.

Sampling and engine keys, weight updates and pause: docs/concepts.md ("The vLLM server", "Weight
sync", "Pause, resume and partial rollouts").  The server is built from parts (see
:class:`VLLMServer`); its actor methods are the :class:`agentloop.servers.base.LLMServer` protocol
(the weight-update ones from :class:`~agentloop.servers.weight_methods.WeightUpdateMethods`).
Translation to and from vLLM's types: :mod:`agentloop.servers.vllm_io` (:func:`engine_args` is
re-exported here).
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
from agentloop.config import ServerSections
from agentloop.errors import ServerError
from agentloop.servers.base import GOES_ON_WITHOUT, GenerateBatcher, PauseGate, ServerDeadError
from agentloop.servers.inflight_update import InFlightUpdate, collect_stream
from agentloop.servers.vllm_io import (
    FINISH_TO_STOP,
    engine_args,
    no_outputs,
    sampled_logprobs,
    sampling_params,
    stop_sequence,
    to_token_output,
    with_cached_tokens,
)
from agentloop.servers.vllm_weights import VLLMWeights
from agentloop.servers.weight_methods import WeightUpdateMethods
from agentloop.servers.weight_sync import WORKER_EXTENSION
from agentloop.types import StopReason, TokenDelta, TokenOutput
from agentloop.utils.gcheap import freeze_startup_heap
from agentloop.utils.process import restore_normal_priority

logger = logging.getLogger(__name__)


CPU_SHUTDOWN_GRACE_S = 1.0
"""Seconds a CPU engine's processes get to exit on :meth:`VLLMServer.shutdown` before vLLM
force-kills them (its default waits ~4.6 s on this machine kind)."""


class VLLMServer(WeightUpdateMethods):
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
    weights: VLLMWeights

    def __init__(self, sections: ServerSections, server_index: int = 0) -> None:
        self.server_index = server_index
        self.engine_cfg = sections.engine
        self.server_cfg = sections.server
        self.model_cfg = sections.model_config
        self.prompt_length = self.engine_cfg.prompt_length
        self.response_length = self.engine_cfg.response_length
        self.engine: Any = None
        self._on_cpu = False
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
        self._on_cpu = on_cpu
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
        """vLLM ``SamplingParams`` within this server's budgets
        (:func:`~agentloop.servers.vllm_io.sampling_params`)."""
        return sampling_params(
            params, prompt_len, self.prompt_length, self.response_length, stream=stream
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
                to_token_output(final, want_logprobs, self._extra_fields(),
                                getattr(params, "routed_experts_prompt_start", 0))
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
                        else no_outputs()
                    ):
                        completion = out.outputs[0]
                        ids = list(completion.token_ids)
                        log_probs = sampled_logprobs(completion, ids) if want_logprobs else None
                        finished = bool(out.finished)
                        reason = completion.finish_reason or "abort"
                        stop = FINISH_TO_STOP.get(reason, StopReason.STOP) if finished else None
                        versions += [self.global_steps] * len(ids)
                        extra = (
                            with_cached_tokens(
                                self.inflight.versioned(self._extra_fields(), versions), out
                            )
                            if finished
                            else {}
                        )
                        yield TokenDelta(
                            token_ids=ids, log_probs=log_probs, finished=finished, stop_reason=stop,
                            stop_sequence=stop_sequence(completion) if finished else None,
                            extra_fields=extra,
                            routed_experts=getattr(completion, "routed_experts", None),
                            routed_experts_start=getattr(params, "routed_experts_prompt_start", 0),
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
        # queues any request already past the gate but not yet in the engine, so nothing runs until
        # resume().
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

    async def set_weight_update(self, mode: str) -> None:
        """Switch ``server.weight_update`` (``abort`` | ``drain`` | ``keep``) for later requests and
        updates; refused while a request runs or an update is open
        (:meth:`InFlightUpdate.set_mode`)."""
        self.inflight.set_mode(
            mode, busy=self.weights.open is not None or bool(self.gate.in_flight)
        )

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
            # vLLM CPU's graceful engine exit takes ~4.6 s (measured) before it would force-kill;
            # an idle CPU engine holds nothing that needs it. GPU engines keep vLLM's default.
            grace = CPU_SHUTDOWN_GRACE_S if self._on_cpu else None
            self.engine.shutdown(timeout=grace)
            self.engine = None
