"""SGLang backend: one ``sglang.Engine`` hosted in a Ray actor behind the same protocol as vLLM.

Selected with ``actor_rollout_ref.rollout.name: sglang`` (``pip install -e .[sglang]``; GPU only).
Token in, token out: each request carries its router request id as SGLang's ``rid``, so
:meth:`SGLangServer.abort` reaches it; outputs keep ``stop`` / ``length`` / ``aborted`` apart and
carry log-probs when asked. :class:`SGLangEngineAPI` (:mod:`agentloop.servers.sglang_engine`) is
the one place that touches SGLang (its ``Engine`` API of the 0.5 line); :class:`SGLangServer` holds
what is ours (pause gate, weight-update protocol, stop reasons, versions). :func:`engine_kwargs`
(:mod:`agentloop.servers.sglang_io`, with the other translations) maps verl's rollout keys to
SGLang's server arguments (``engine_kwargs.sglang`` last, overriding anything); both are
re-exported here with ``load_sglang``, ``server_args``, ``structured_sampling`` and
``INSTALL_HINT``. Status: **untested on a GPU so far**.

Spec (protocol mapping, config, status): docs/sglang.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from agentloop.batch.routed_experts import PROMPT_START_KEY
from agentloop.config import ServerSections
from agentloop.config.routing_replay import check_routing_replay
from agentloop.errors import ConfigError, ServerError
from agentloop.servers.base import GOES_ON_WITHOUT, GenerateBatcher, PauseGate, ServerDeadError
from agentloop.servers.sglang_engine import (  # noqa: F401 (re-exports)
    INSTALL_HINT,
    SGLangEngineAPI,
    load_sglang,
)
from agentloop.servers.sglang_io import (  # noqa: F401 (re-exports)
    FINISH_TO_STOP,
    engine_kwargs,
    request_sampling,
    routed_experts,
    server_args,
    structured_sampling,
    to_token_output,
    with_cached_tokens,
)
from agentloop.servers.sglang_weights import SGLangWeights
from agentloop.servers.weight_methods import WeightUpdateMethods
from agentloop.types import StopReason, TokenDelta, TokenOutput

logger = logging.getLogger(__name__)


class SGLangServer(WeightUpdateMethods):
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
    weights: SGLangWeights

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
        # routing replay: the model's (layers, top_k), None when off
        self.routed_shape = check_routing_replay(self.engine_cfg, self.model_cfg)
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
        """SGLang's sampling keys and ``max_new_tokens`` within this server's budgets
        (:func:`~agentloop.servers.sglang_io.request_sampling`)."""
        return request_sampling(params, prompt_len, self.prompt_length, self.response_length)

    def _extra_fields(self) -> dict[str, Any]:
        return {"server_index": self.server_index, "global_steps": self.global_steps}

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
                        routed_experts_start=self._routed_start(sampling_params),
                    )
                except Exception as e:
                    self._raise_if_dead(e)
                    raise
            output = (
                to_token_output(result, want_logprobs, self._extra_fields(),
                                self._routing(sampling_params))
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

    def _routed_start(self, sampling_params: dict[str, Any]) -> int | None:
        """Routing replay: the first position whose routing this request asks for (the router's
        ``routed_experts_prompt_start``; earlier turns' rows are known); None when off."""
        if self.routed_shape is None:
            return None
        return int(sampling_params.get(PROMPT_START_KEY) or 0)

    def _routing(self, sampling_params: dict[str, Any]) -> tuple[tuple[int, int], int] | None:
        start = self._routed_start(sampling_params)
        return None if start is None or self.routed_shape is None else (self.routed_shape, start)

    def _stream_routing(self, meta: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        """The last chunk's routed experts as TokenDelta fields (SGLang sends them once, at the
        end); empty when routing replay is off."""
        routing = self._routing(params)
        if routing is None:
            return {}
        return {"routed_experts": routed_experts(meta, routing[0]),
                "routed_experts_start": routing[1]}

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
                            stream=True, routed_experts_start=self._routed_start(sampling_params),
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
                        FINISH_TO_STOP.get(finish.get("type", "abort"), StopReason.STOP)
                        if finish
                        else None
                    )
                    yield TokenDelta(
                        token_ids=ids, log_probs=lps[: len(ids)] if want_logprobs else None,
                        finished=stop is not None, stop_reason=stop,
                        extra_fields=(
                            with_cached_tokens(self._extra_fields(), meta) if stop else {}
                        ),
                        **(self.gate.signals(stop, request_id, max_tokens) if stop else {}),
                        **(self._stream_routing(meta, sampling_params) if stop else {}),
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
