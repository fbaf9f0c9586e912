"""SGLang backend: one ``sglang.Engine`` hosted in a Ray actor behind the same protocol as vLLM.

Selected with ``actor_rollout_ref.rollout.name: sglang`` (``pip install -e .[sglang]``; GPU only).
Token in, token out: each request carries its router request id as SGLang's ``rid``, so
:meth:`SGLangServer.abort` reaches it; outputs keep ``stop`` / ``length`` / ``aborted`` apart and
carry log-probs when asked. :class:`SGLangEngineAPI` is the one place that touches SGLang (its
``Engine`` API of the 0.5 line); :class:`SGLangServer` holds what is ours (pause gate, weight-update
protocol, stop reasons, versions). :func:`engine_kwargs` maps verl's rollout keys to SGLang's server
arguments (``engine_kwargs.sglang`` last, overriding anything). Status: **untested on a GPU so
far**.

Spec (protocol mapping, config, status): docs/sglang.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from agentloop.config import EngineConfig, ModelConfig, ServerConfig, ServerSections
from agentloop.errors import ConfigError, ServerError
from agentloop.servers.base import (
    GOES_ON_WITHOUT,
    GenerateBatcher,
    PauseGate,
    ServerDeadError,
    load_whole,
)
from agentloop.servers.sglang_weights import SGLangWeights
from agentloop.servers.weight_sync import WeightBucket
from agentloop.types import StopReason, TokenDelta, TokenOutput

logger = logging.getLogger(__name__)

_FINISH_TO_STOP = {
    "stop": StopReason.STOP, "length": StopReason.LENGTH, "abort": StopReason.ABORTED,
}
_SAMPLING = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "stop_token_ids": "stop_token_ids", "stop": "stop",
    "ignore_eos": "ignore_eos", "seed": "sampling_seed", "n": "n",
}
INSTALL_HINT = "pip install -e '.[sglang]' (SGLang needs a CUDA GPU)"
_STRUCTURED = {
    "json": "json_schema", "json_object": "json_schema", "regex": "regex", "grammar": "ebnf",
    "structural_tag": "structural_tag",
}


def structured_sampling(entry: dict[str, Any]) -> dict[str, Any]:
    """SGLang's sampling keys for a ``structured_outputs`` entry (vLLM's field names;
    gateway/constraints.py).

    Raises:
        ServerError: a constraint SGLang has no sampling key for (``choice``, whitespace options).
    """
    out: dict[str, Any] = {}
    for key, value in entry.items():
        if value is None or value is False:
            continue
        if key not in _STRUCTURED:
            raise ServerError(
                f"structured output {key!r} is not supported with "
                f"rollout.name=sglang; SGLang takes "
                f"{sorted(_STRUCTURED)}"
            )
        if key == "json_object":
            value = '{"type": "object"}'
        elif key == "json" and not isinstance(value, str):
            value = json.dumps(value)
        out[_STRUCTURED[key]] = value
    return out


def load_sglang() -> tuple[Any, Any]:
    """``(sglang.Engine, sglang.srt.managers.io_struct)``, or a ConfigError naming the fix."""
    try:  # SGLang is an optional dependency (the [sglang] extra)
        import sglang
        from sglang.srt.managers import io_struct
    except ImportError as e:
        raise ConfigError(
            f"actor_rollout_ref.rollout.name=sglang but SGLang is not "
            f"installed ({e}); "
            f"install it with {INSTALL_HINT}, or use rollout.name=vllm"
        ) from e
    return sglang.Engine, io_struct


def server_args(
    engine: EngineConfig, server: ServerConfig, model: ModelConfig, server_index: int = 0
) -> dict[str, Any]:
    """SGLang ``ServerArgs`` from the typed config (verl's key names; ``engine_kwargs.sglang``
    last)."""
    kwargs: dict[str, Any] = {
        "model_path": model.local_path,
        "trust_remote_code": model.trust_remote_code,
        "dtype": engine.dtype,
        "tp_size": engine.tensor_model_parallel_size,
        "mem_fraction_static": engine.gpu_memory_utilization,
        "context_length": engine.context_length,
        "max_running_requests": engine.max_num_seqs,
        "chunked_prefill_size": max(engine.max_num_batched_tokens, engine.context_length),
        "disable_radix_cache": not engine.enable_prefix_caching,
        "enable_memory_saver": engine.free_cache_engine,
        "random_seed": engine.seed + int(server_index),
        "load_format": engine.load_format,
        "skip_tokenizer_init": True,  # token in, token out
        "log_level": "error",
    }
    if model.local_tokenizer_path:
        kwargs["tokenizer_path"] = model.local_tokenizer_path
    if server.priority not in (None, "", "fcfs"):
        kwargs["enable_priority_scheduling"] = True
    kwargs.update(dict(engine.engine_kwargs.get("sglang") or {}))
    return kwargs


def engine_kwargs(rollout: Any, model: Any, server_index: int = 0) -> dict[str, Any]:
    """:func:`server_args` from the rollout and model slices
    (:meth:`ServerSections.from_slices`)."""
    sections = ServerSections.from_slices(rollout, model)
    return server_args(sections.engine, sections.server, sections.model_config, server_index)


class SGLangEngineAPI:
    """The SGLang calls the server makes, in one place (see the module docstring)."""

    def __init__(self, engine: Any, io_struct: Any, serializer: Any = None) -> None:
        self.engine, self.io, self._serializer = engine, io_struct, serializer
        self.tm = engine.tokenizer_manager
        args = getattr(engine, "server_args", None)
        self.incremental_stream = bool(getattr(args, "incremental_streaming_output", False))
        self.tp_size = int(getattr(args, "tp_size", 1) or 1)

    async def generate(
        self, input_ids: list[int], sampling: dict[str, Any], rid: str, *, logprobs: bool,
        image_data: list[Any] | None, priority: int | None, stream: bool,
        video_data: list[Any] | None = None,
    ) -> Any:
        kwargs: dict[str, Any] = {
            "input_ids": list(input_ids), "sampling_params": sampling, "rid": rid,
            "return_logprob": logprobs, "stream": stream,
        }
        if image_data:
            kwargs["image_data"] = image_data
        if video_data:
            kwargs["video_data"] = video_data
        if priority:
            kwargs["priority"] = int(priority)
        return await self.engine.async_generate(**kwargs)

    async def abort(self, rid: str) -> None:
        result = self.tm.abort_request(rid)
        if asyncio.iscoroutine(result):
            await result

    async def release_memory(self) -> None:
        await self.tm.release_memory_occupation(self.io.ReleaseMemoryOccupationReqInput(), None)

    async def resume_memory(self) -> None:
        await self.tm.resume_memory_occupation(self.io.ResumeMemoryOccupationReqInput(), None)

    async def load_tensors(self, named: list[tuple[str, Any]]) -> None:
        if self._serializer is None:
            # SGLang is an optional dependency, installed where this engine runs
            from sglang.srt.utils import MultiprocessingSerializer

            self._serializer = MultiprocessingSerializer
        # one per TP rank
        payload = [self._serializer.serialize(named) for _ in range(self.tp_size)]
        result = await self.tm.update_weights_from_tensor(
            self.io.UpdateWeightsFromTensorReqInput(
                serialized_named_tensors=payload, flush_cache=False
            ),
            None,
        )
        ok = result[0] if isinstance(result, tuple) else getattr(result, "success", True)
        if not ok:
            raise ServerError(f"SGLang refused the weights: {result}")

    async def flush_cache(self) -> None:
        await self.tm.flush_cache()

    def child_pids(self) -> list[int]:
        get = getattr(self.engine, "get_all_child_pids", None)
        return list(get()) if get is not None else []

    def shutdown(self) -> None:
        self.engine.shutdown()


class SGLangServer:
    """One SGLang engine.  Build with :meth:`start` (async) before use; same constructor as
    ``VLLMServer``.

    Parts: ``api`` (:class:`SGLangEngineAPI`, set by :meth:`start`), ``gate`` (the
    :class:`~agentloop.servers.base.PauseGate` behind pause / resume), ``batcher`` (the
    :class:`~agentloop.servers.base.GenerateBatcher` behind ``generate_batch``) and ``weights``
    (:class:`~agentloop.servers.sglang_weights.SGLangWeights`: weight updates, the served version).

    Args:
        sections: the typed engine, server and model sections (``ServerSections.of(cfg)``).
        server_index: rank of this server among all servers (for logs and seeds).

    Raises:
        ConfigError: ``server.weight_update`` is ``keep`` (vLLM only).
    """

    supports_sleep: bool = False

    def __init__(self, sections: ServerSections, server_index: int = 0) -> None:
        self.server_index = server_index
        self.engine_cfg = sections.engine
        self.server_cfg = sections.server
        self.model_cfg = sections.model_config
        if self.server_cfg.weight_update not in ("abort", "drain"):
            raise ConfigError(
                "actor_rollout_ref.rollout.server.weight_update: keep is "
                "implemented for vLLM only; use "
                "abort (the default) or drain with rollout.name: sglang"
            )
        self.prompt_length = self.engine_cfg.prompt_length
        self.response_length = self.engine_cfg.response_length
        self.api: SGLangEngineAPI | None = None
        self.gate = PauseGate()
        self.batcher = GenerateBatcher(self.generate)
        self.weights = SGLangWeights(server_index, self._require, self.gate, self._raise_if_dead)
        self._sleeping = False

    @classmethod
    def from_slices(cls, rollout: Any, model: Any, server_index: int = 0) -> SGLangServer:
        """A server from the ``rollout`` and ``model`` config slices
        (:meth:`ServerSections.from_slices`)."""
        return cls(ServerSections.from_slices(rollout, model), server_index)

    @property
    def global_steps(self) -> int:
        """Version of the weights being served (verl's name; 0 before any update):
        ``weights.version``."""
        return self.weights.version

    async def start(self, engine_api: SGLangEngineAPI | None = None) -> dict[str, Any]:
        """Create the engine (``engine_api``: an already built one, for tests); returns facts
        about it."""
        t0 = time.perf_counter()
        if engine_api is None:
            engine_cls, io_struct = load_sglang()
            args = server_args(self.engine_cfg, self.server_cfg, self.model_cfg, self.server_index)
            try:
                engine_api = SGLangEngineAPI(engine_cls(**args), io_struct)
            except Exception as e:
                raise ServerError(
                    f"SGLang server {self.server_index} failed to start with {args}: {e}"
                ) from e
        self.api = engine_api
        self.supports_sleep = bool(
            getattr(getattr(engine_api.engine, "server_args", None), "enable_memory_saver", False)
        )
        return {
            "platform": "cuda", "backend": "sglang", "start_s": time.perf_counter() - t0,
            "pid": os.getpid(),
        }

    def _require(self) -> SGLangEngineAPI:
        if self.api is None:
            raise ServerError(
                f"SGLang server {self.server_index} is not started; call start() first"
            )
        return self.api

    def _sampling(self, prompt_len: int, params: dict[str, Any]) -> tuple[dict[str, Any], int]:
        budget = self.prompt_length + self.response_length - prompt_len
        max_tokens = int(min(params.get("max_tokens") or min(self.response_length, budget), budget))
        out = {
            ours: params[theirs]
            for theirs, ours in _SAMPLING.items()
            if params.get(theirs) is not None
        }
        if "top_k" in out and int(out["top_k"]) <= 0:
            out["top_k"] = -1  # verl's "no top-k"
        if params.get("structured_outputs"):  # a grammar from the gateway (gateway/constraints.py)
            out.update(structured_sampling(params["structured_outputs"]))
        out["max_new_tokens"] = max_tokens
        return out, max_tokens

    def _extra_fields(self) -> dict[str, Any]:
        return {"server_index": self.server_index, "global_steps": self.global_steps}

    def _output(self, result: dict[str, Any], want_logprobs: bool) -> TokenOutput:
        meta = result.get("meta_info") or {}
        ids = [int(t) for t in result.get("output_ids") or []]
        finish = (meta.get("finish_reason") or {}).get("type", "abort")
        log_probs = (
            [float(t[0]) for t in meta.get("output_token_logprobs") or []][: len(ids)]
            if want_logprobs
            else None
        )
        return TokenOutput(
            token_ids=ids, log_probs=log_probs,
            stop_reason=_FINISH_TO_STOP.get(finish, StopReason.STOP),
            extra_fields=self._extra_fields(),
        )

    def _raise_if_dead(
        self, error: BaseException | None,
        then: str = "the request is retried on another server and this one restarted",
    ) -> None:
        if self._engine_dead():
            why = f" ({type(error).__name__}: {error})" if error is not None else ""
            raise ServerDeadError(
                f"SGLang server {self.server_index}: the engine's processes died{why}; {then}",
                self.server_index,
            ) from error

    def _engine_dead(self) -> bool:
        if self.api is None:
            return False
        for pid in self.api.child_pids():
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                continue
        return False

    async def generate(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
        image_data: list[Any] | None = None, video_data: list[Any] | None = None,
    ) -> TokenOutput:
        """Generate from token ids (verl's sampling keys; ``priority`` from the router when
        configured)."""
        api = self._require()
        want_logprobs = bool(sampling_params.get("logprobs"))
        sampling, max_tokens = self._sampling(len(prompt_ids), sampling_params)
        if max_tokens <= 0:
            return TokenOutput(
                token_ids=[], log_probs=[] if want_logprobs else None,
                stop_reason=StopReason.LENGTH, extra_fields=self._extra_fields(),
            )
        await self.weights.wait()  # an open weight update: wait for the new weights
        result = None
        async with self.gate.admitted(request_id) as admitted:
            if admitted:
                try:
                    result = await api.generate(
                        prompt_ids, sampling, request_id, logprobs=want_logprobs,
                        image_data=image_data, priority=sampling_params.get("priority"),
                        stream=False, video_data=video_data,
                    )
                except Exception as e:
                    self._raise_if_dead(e)
                    raise
            output = (
                self._output(result, want_logprobs)
                if result is not None
                else TokenOutput(
                    token_ids=[], log_probs=[] if want_logprobs else None,
                    stop_reason=StopReason.ABORTED, extra_fields=self._extra_fields(),
                )
            )
            return output.model_copy(
                update=self.gate.signals(output.stop_reason, request_id, max_tokens)
            )

    async def generate_batch(
        self, requests: list[dict[str, Any]]
    ) -> AsyncIterator[list[tuple[int, Any]]]:
        """Many :meth:`generate` calls in one, results in groups as they finish (see
        :class:`~agentloop.servers.base.GenerateBatcher`)."""
        async for group in self.batcher.run(requests):
            yield group

    def busy_seconds(self) -> float:
        """Seconds with at least one request in the engine (:meth:`PauseGate.busy_seconds`)."""
        return self.gate.busy_seconds()

    async def generate_stream(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
        image_data: list[Any] | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """Like :meth:`generate`, yielding ids as they are sampled (SGLang's cumulative or
        incremental chunks become deltas); the last chunk has ``finished=True`` and the stop reason.
        """
        api = self._require()
        want_logprobs = bool(sampling_params.get("logprobs"))
        sampling, max_tokens = self._sampling(len(prompt_ids), sampling_params)
        if max_tokens <= 0:
            yield TokenDelta(token_ids=[], log_probs=[] if want_logprobs else None, finished=True,
                             stop_reason=StopReason.LENGTH, extra_fields=self._extra_fields())
            return
        await self.weights.wait()  # an open weight update: wait for the new weights
        seen, seen_lp, stop = 0, 0, None
        async with self.gate.admitted(request_id) as admitted:
            try:
                chunks = (
                    (
                        await api.generate(
                            prompt_ids, sampling, request_id, logprobs=want_logprobs,
                            image_data=image_data, priority=sampling_params.get("priority"),
                            stream=True,
                        )
                    )
                    if admitted
                    else None
                )
                async for chunk in chunks if chunks is not None else _nothing():
                    meta = chunk.get("meta_info") or {}
                    ids = [int(t) for t in chunk.get("output_ids") or []]
                    lps = [float(t[0]) for t in meta.get("output_token_logprobs") or []]
                    if not api.incremental_stream:  # cumulative chunks: keep what is new
                        ids, lps = ids[seen:], lps[seen_lp:]
                    seen, seen_lp = seen + len(ids), seen_lp + len(lps)
                    finish = meta.get("finish_reason")
                    stop = (
                        _FINISH_TO_STOP.get(finish.get("type", "abort"), StopReason.STOP)
                        if finish
                        else None
                    )
                    yield TokenDelta(
                        token_ids=ids, log_probs=lps[: len(ids)] if want_logprobs else None,
                        finished=stop is not None, stop_reason=stop,
                        extra_fields=self._extra_fields() if stop else {},
                        **(self.gate.signals(stop, request_id, max_tokens) if stop else {}),
                    )
            except Exception as e:
                self._raise_if_dead(e)
                raise
            if stop is None:
                yield TokenDelta(
                    token_ids=[], log_probs=[] if want_logprobs else None, finished=True,
                    stop_reason=StopReason.ABORTED, extra_fields=self._extra_fields(),
                    **self.gate.signals(StopReason.ABORTED, request_id, max_tokens),
                )

    async def abort(self, request_id: str) -> None:
        """Abort a request (its generate returns ``aborted`` with the tokens so far); one held by a
        pause ends aborted without running."""
        self.gate.caller_abort(request_id)
        await self._require().abort(request_id)

    async def pause(self, for_update: bool = False) -> int:
        """Abort what runs (each returns its tokens so far, tagged for the router to resume) and
        hold new requests until :meth:`resume`; the prefix cache is kept."""
        api = self._require()
        if self.gate.paused:
            return 0
        self._raise_if_dead(None, GOES_ON_WITHOUT.format("pause"))
        running = list(self.gate.in_flight)
        n = self.gate.close(for_update)
        try:
            await asyncio.gather(*(api.abort(rid) for rid in running))
        except Exception as e:
            self.gate.open()
            self._raise_if_dead(e, GOES_ON_WITHOUT.format("pause"))
            raise
        return n

    async def resume(self) -> None:
        """Let held and new requests run again (no-op when not paused)."""
        self.gate.open()

    async def check_health(self) -> dict[str, Any]:
        """Raises :class:`ServerDeadError` when the engine's processes died; else the server's
        facts."""
        self._require()
        if self._engine_dead():
            raise ServerDeadError(
                f"SGLang server {self.server_index}: the engine's processes died", self.server_index
            )
        return {
            "server_index": self.server_index, "global_steps": self.global_steps,
            "pid": os.getpid(),
        }

    async def wake_up(self) -> None:
        """Re-acquire weights and KV cache (a logged no-op without ``enable_memory_saver``)."""
        if not self.supports_sleep:
            logger.info(
                "server %d: wake_up is a no-op (SGLang started without enable_memory_saver)",
                self.server_index,
            )
            return
        if self._sleeping:
            await self._engine_call(self._require().resume_memory, "wake_up")
            self._sleeping = False

    async def sleep(self) -> None:
        """Release weights and KV cache between rollouts (a logged no-op without
        ``enable_memory_saver``)."""
        if not self.supports_sleep:
            logger.info(
                "server %d: sleep is a no-op (SGLang started without enable_memory_saver)",
                self.server_index,
            )
            return
        if not self._sleeping:
            await self._engine_call(self._require().flush_cache, "sleep")
            await self._engine_call(self._require().release_memory, "sleep")
            self._sleeping = True

    async def set_global_steps(self, global_steps: int) -> None:
        """Set the reported weight version without loading weights."""
        self.weights.version = int(global_steps)

    async def begin_weight_update(
        self, global_steps: int | None = None, *, transport: str = "auto"
    ) -> None:
        """Open an update: new requests wait, in-flight ones finish on the old weights first
        (:meth:`SGLangWeights.begin`)."""
        self._require_awake()
        await self.weights.begin(global_steps, transport)

    async def load_weight_bucket(self, bucket: WeightBucket) -> None:
        """Load one bucket (HF names) into the engine."""
        await self.weights.load(bucket)

    async def finish_weight_update(self) -> dict[str, Any]:
        """Flush the prefix cache, publish the version, let requests run; returns what was
        loaded."""
        return await self.weights.finish()

    async def abort_weight_update(self) -> None:
        """Close an open update without publishing its version (no-op when none is open)."""
        await self.weights.abort()

    async def update_weights(self, named_tensors: Any, global_steps: int | None = None, *,
                             transport: str = "auto") -> dict[str, Any]:
        """The whole update in one call: begin, one bucket, finish."""
        self._require_awake()
        return await load_whole(self.weights, named_tensors, global_steps, transport)

    def _require_awake(self) -> None:
        self._require()
        if self._sleeping:
            raise ServerError(
                f"SGLang server {self.server_index} is asleep: wake_up() before updating weights"
            )

    async def clear_kv_cache(self) -> None:
        """Drop the prefix (radix) cache."""
        await self._engine_call(self._require().flush_cache, "clear_kv_cache")

    async def _engine_call(self, call: Callable[[], Awaitable[Any]], what: str) -> Any:
        """A server-wide engine call: refused at once when the engine's processes died (a call to a
        dead scheduler may never be answered), and a failure it meets then is a ServerDeadError, so
        the manager goes on without this server and restarts it instead of failing its caller."""
        self._raise_if_dead(None, GOES_ON_WITHOUT.format(what))
        try:
            return await call()
        except Exception as e:
            self._raise_if_dead(e, GOES_ON_WITHOUT.format(what))
            raise

    async def start_profile(self, **kwargs: Any) -> None:
        """Not wired for SGLang yet: a logged no-op."""
        logger.warning(
            "server %d: start_profile is a no-op on the SGLang backend", self.server_index
        )

    async def stop_profile(self) -> None:
        """See :meth:`start_profile`."""

    async def shutdown(self) -> None:
        """Stop the engine's processes."""
        if self.api is not None:
            self.api.shutdown()
            self.api = None


async def _nothing() -> AsyncIterator[Any]:
    return
    yield
