"""ScriptedServer: a fake inference engine for unit tests (no Ray, no torch, no model).

It implements :class:`agentloop.servers.base.LLMServer`, so agent loops, the router and workers
run against it exactly as against vLLM.  Use it in your own tests::

    server = ScriptedServer([[11, 12, 2], RuntimeError("boom")], eos_token_id=2)
    manager = AsyncLLMServerManager([server])

Replies come from the script (token lists shaped to ``max_tokens`` with a stop reason, TokenOutputs
as they are, Exceptions raised); ``abort``, ``pause`` / ``resume``, ``kill_engine`` and weight
updates behave as on a real server.  The exact reply rules:
docs/testing.md#the-scripted-engine-scriptedserver.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import numpy as np

from agentloop.errors import ServerError
from agentloop.servers.base import GenerateBatcher, PauseGate, ServerDeadError
from agentloop.servers.weight_sync import WeightBucket
from agentloop.types import StopReason, TokenDelta, TokenOutput, unchecked

Script = list[int] | TokenOutput | Exception
"""One scripted reply: token ids, a ready TokenOutput, or an exception to raise."""

ScriptFn = Callable[[list[int], dict[str, Any], str], "list[int] | TokenOutput"]
"""A reply function ``(prompt_ids, sampling_params, request_id) -> reply``."""


def fake_routed_experts(
    ids: Sequence[int], start: int, shape: tuple[int, int], num_experts: int = 8
) -> np.ndarray:
    """Deterministic routing of positions ``start..len(ids)-1`` of ``ids``: expert ``(7 * token +
    3 * position + 5 * layer + j) % num_experts`` for choice ``j`` of ``layer`` (distinct choices
    for ``top_k <= num_experts``); uint8 [n, layers, top_k], as vLLM returns it."""
    layers, top_k = shape
    pos = np.arange(start, len(ids), dtype=np.int64)
    base = 7 * np.asarray(ids[start:], dtype=np.int64) + 3 * pos
    grid = base[:, None, None] + 5 * np.arange(layers)[None, :, None] + np.arange(top_k)
    return (grid % num_experts).astype(np.uint8)


_LOG_PROB_CYCLE = tuple(-0.1 * (i + 1) for i in range(10))


def fake_log_probs(n: int) -> list[float]:
    """Deterministic, finite, negative log-probabilities: -0.1, -0.2, … -1.0, then repeating."""
    # built from the ten values (not one expression per token): the fake answers every call
    whole, rest = divmod(n, 10)
    return list(_LOG_PROB_CYCLE * whole + _LOG_PROB_CYCLE[:rest])


class ScriptedServer:
    """Replies from a script (the exact rules: docs/testing.md#the-scripted-engine-scriptedserver).

    Args:
        responses: a list consumed in order (token id lists, TokenOutputs, or Exceptions to raise),
        or
            a callable ``(prompt_ids, sampling_params, request_id) -> list[int] | TokenOutput``;
            None echoes the last ``min(4, max_tokens)`` prompt ids.
        eos_token_id: a reply ending with it has ``stop_reason='stop'``.
        delay: seconds to wait before replying.
        token_delay: seconds per token of the reply, handed out one by one (a pause or abort can cut
        it). name: shown in error messages.
        routed_experts: ``(layers, top_k)``: every reply carries :func:`fake_routed_experts` for
            the positions the engine would have run (from the request's
            ``routed_experts_prompt_start`` to the last sampled token, excluded), as vLLM does
            with routing replay on; None: no routing (a dense model).

    Attributes:
        calls: one dict per ``generate`` call (request_id, prompt_ids, sampling_params, image_data).
        counts: calls of ``wake_up``, ``sleep``, ``update_weights`` and ``abort``.
        weights, buckets: the tensors of the last update; the tensor names of each bucket of a
        streamed one. global_steps: the weight version put in every reply. lifecycle: sleep,
        wake_up, weight-update steps, pause and resume, in call order. gate, batcher: the
        ``PauseGate`` behind pause / resume, the ``GenerateBatcher`` behind ``generate_batch``.
    """

    supports_sleep = True

    def __init__(
        self, responses: Sequence[Script] | ScriptFn | None = None, *,
        eos_token_id: int | None = None, delay: float = 0.0, token_delay: float = 0.0,
        name: str = "scripted", routed_experts: tuple[int, int] | None = None,
    ) -> None:
        self.routed_experts = routed_experts
        self._script: list[Script] | ScriptFn | None = (
            responses if callable(responses) or responses is None else list(responses)
        )
        self._next = 0
        self.eos_token_id = eos_token_id
        self.delay = delay
        self.token_delay = token_delay
        self.name = name
        self.calls: list[dict[str, Any]] = []
        self.counts = {
            "wake_up": 0, "sleep": 0, "update_weights": 0, "abort": 0, "clear_kv_cache": 0,
            "start_profile": 0, "stop_profile": 0,
        }
        self.weights: dict[str, Any] = {}
        self.global_steps = 0
        self.buckets: list[list[str]] = []
        self.lifecycle: list[str] = []
        self._open_version: int | None = None
        self._pending: dict[str, list[asyncio.Event]] = {}
        self.engine_dead = False
        self._stalled = False
        self.gate = PauseGate()
        self.batcher = GenerateBatcher(self.generate)

    @property
    def remaining(self) -> int | None:
        """Scripted replies not consumed yet (None for a callable or echo script)."""
        return len(self._script) - self._next if isinstance(self._script, list) else None

    def _reply(self, prompt_ids: list[int], params: dict[str, Any], request_id: str) -> Any:
        if self._script is None:
            max_tokens = params.get("max_tokens")
            n = 4 if max_tokens is None else max(0, min(4, int(max_tokens)))
            return list(prompt_ids[len(prompt_ids) - n :]) if n else []
        if callable(self._script):
            return self._script(list(prompt_ids), params, request_id)
        if self._next >= len(self._script):
            raise ServerError(
                f"{self.name}: script exhausted: {len(self._script)} replies were scripted "
                f"and all were used; "
                f"request {request_id!r} is call {len(self.calls)} — add more replies or "
                f"pass a callable"
            )
        reply = self._script[self._next]
        self._next += 1
        return reply

    async def _wait(self, request_id: str, seconds: float) -> bool:
        """Sleep ``seconds``; True when the request was aborted (or paused) meanwhile."""
        if not seconds:
            return False
        event = asyncio.Event()
        self._pending.setdefault(request_id, []).append(event)
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), seconds)
            return event.is_set()
        finally:
            waiting = self._pending.get(request_id, [])
            if event in waiting:
                waiting.remove(event)
            if not waiting:
                self._pending.pop(request_id, None)

    async def generate(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
        image_data: list[Any] | None = None,
    ) -> TokenOutput:
        """Record the call, wait while paused, wait ``delay`` (abortable), then reply from the
        script (one token per ``token_delay``, abortable)."""
        call = {"request_id": request_id, "prompt_ids": list(prompt_ids),
                "sampling_params": dict(sampling_params), "image_data": image_data}
        self.calls.append(call)
        self._raise_if_dead()
        async with self.gate.admitted(request_id) as admitted:
            output = (
                await self._generate(prompt_ids, sampling_params, request_id) if admitted else None
            )
            if output is None:  # aborted before the reply was made
                output = TokenOutput(
                    token_ids=[], log_probs=[] if sampling_params.get("logprobs") else None,
                    stop_reason=StopReason.ABORTED,
                    extra_fields={"global_steps": self.global_steps},
                )
            update: dict[str, Any] = dict(self.gate.signals(output.stop_reason, request_id,
                                                            sampling_params.get("max_tokens")))
            if self.routed_experts is not None and output.routed_experts is None:
                start = int(sampling_params.get("routed_experts_prompt_start") or 0)
                # the last sampled id never ran; nothing ran for a reply with no tokens
                ran = [*prompt_ids, *output.token_ids][:-1]
                if not output.token_ids:
                    ran = list(prompt_ids[:start])
                update["routed_experts"] = fake_routed_experts(ran, start, self.routed_experts)
                update["routed_experts_start"] = start
            # a grammar the script cannot follow (rule 9)
            if sampling_params.get("structured_outputs"):
                update["extra_fields"] = {**output.extra_fields, "structured_outputs_ignored": True}
            return output.model_copy(update=update) if update else output

    async def generate_batch(
        self, requests: list[dict[str, Any]]
    ) -> AsyncIterator[list[tuple[int, Any]]]:
        """Many ``generate`` calls in one, results in groups as they finish (see
        :class:`~agentloop.servers.base.GenerateBatcher`)."""
        async for group in self.batcher.run(requests):
            yield group

    def busy_seconds(self) -> float:
        """Seconds with at least one request past the pause gate
        (:meth:`PauseGate.busy_seconds`)."""
        return self.gate.busy_seconds()

    async def _generate(self, prompt_ids: list[int], sampling_params: dict[str, Any],
                        request_id: str) -> TokenOutput | None:
        aborted = await self._wait(request_id, self.delay)
        self._raise_if_dead()
        if aborted:
            return None
        reply = self._reply(prompt_ids, sampling_params, request_id)
        if isinstance(reply, Exception):
            raise reply
        output = (
            reply if isinstance(reply, TokenOutput) else self._shape(list(reply), sampling_params)
        )
        for i in range(len(output.token_ids) if self.token_delay else 0):
            if await self._wait(request_id, self.token_delay):
                self._raise_if_dead()
                return output.model_copy(update={
                    "token_ids": output.token_ids[:i], "stop_reason": StopReason.ABORTED,
                    "log_probs": None if output.log_probs is None else output.log_probs[:i]})
        return output

    async def generate_stream(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
        image_data: list[Any] | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """The reply of :meth:`generate`, one token per chunk, then a final chunk with the stop
        reason (and the routed experts, as vLLM's last chunk)."""
        out = await self.generate(prompt_ids, sampling_params, request_id, image_data)
        for i, token in enumerate(out.token_ids):
            await asyncio.sleep(0)
            yield TokenDelta(
                token_ids=[token], log_probs=None if out.log_probs is None else [out.log_probs[i]]
            )
        yield TokenDelta(
            token_ids=[], log_probs=None if out.log_probs is None else [], finished=True,
            stop_reason=out.stop_reason, extra_fields=dict(out.extra_fields),
            preempted_by_pause=out.preempted_by_pause, cut_by_update=out.cut_by_update,
            max_tokens=out.max_tokens, routed_experts=out.routed_experts,
            routed_experts_start=out.routed_experts_start,
        )

    def _shape(self, ids: list[int], params: dict[str, Any]) -> TokenOutput:
        """Apply ``max_tokens``, pick the stop reason and add log-probs (rule 4)."""
        raw_max = params.get("max_tokens")
        max_tokens = None if raw_max is None else int(raw_max)
        truncated = max_tokens is not None and len(ids) > max_tokens
        if max_tokens is not None and truncated:
            ids = ids[:max_tokens]
        ends_with_eos = self.eos_token_id is not None and bool(ids) and ids[-1] == self.eos_token_id
        filled = self.eos_token_id is not None and len(ids) == max_tokens
        stop = StopReason.STOP if ends_with_eos or not (truncated or filled) else StopReason.LENGTH
        log_probs = fake_log_probs(len(ids)) if params.get("logprobs") else None
        # an engine's reply, built as a real server's is in its own process: not on the worker's
        # clock there, so not on it here (types.unchecked: the values have the field types)
        return unchecked(TokenOutput, token_ids=ids, log_probs=log_probs, stop_reason=stop,
                         num_preempted=0, extra_fields={"global_steps": self.global_steps})

    async def start(self) -> dict[str, Any]:
        """Nothing to start (servers the manager launches, or restarts, are started with this)."""
        return {"name": self.name}

    def _raise_if_dead(self) -> None:
        if self.engine_dead:
            raise ServerDeadError(f"{self.name}: the engine process died (kill_engine)")

    def kill_engine(self) -> None:
        """Simulate the engine process dying: pending and later requests raise ServerDeadError."""
        self.engine_dead = True
        for events in self._pending.values():
            for event in events:
                event.set()

    async def freeze(self, seconds: float) -> None:
        """Block this actor's event loop for ``seconds`` (a synchronous sleep inside it): nothing it
        holds or is sent answers meanwhile, health checks included (a server actor hung in its own
        code).
        """
        time.sleep(seconds)

    def stall_weight_updates(self) -> None:
        """From now on ``begin_weight_update`` never returns (a server hung inside a weight
        update)."""
        self._stalled = True

    async def check_health(self) -> dict[str, Any]:
        """Raises ServerDeadError after :meth:`kill_engine`."""
        self._raise_if_dead()
        return {"name": self.name, "global_steps": self.global_steps}

    async def abort(self, request_id: str) -> None:
        """End the pending call(s) with this id at once, with ``stop_reason='aborted'`` and the
        tokens produced so far (a call held by a pause ends so without running)."""
        self.counts["abort"] += 1
        self.gate.caller_abort(request_id)
        for event in self._pending.pop(request_id, []):
            event.set()

    async def pause(self, for_update: bool = False) -> int:
        """Cut every call in flight (rule 8) and hold new ones until :meth:`resume`; returns how
        many calls were in flight (0 when already paused; ``for_update``: cut by a weight update,
        tagged ``cut_by_update``). Raises ServerDeadError after :meth:`kill_engine`, as every
        server-wide call below does (a vLLM server's dead engine)."""
        self._raise_if_dead()
        self.lifecycle.append("pause")
        n = self.gate.close(for_update)
        for events in self._pending.values():
            for event in events:
                event.set()
        return n

    @property
    def paused(self) -> bool:
        """Whether :meth:`pause` holds new calls."""
        return self.gate.paused

    async def resume(self) -> None:
        """Let held and new calls run again (they fail over when the engine died: then this
        raises too)."""
        self.lifecycle.append("resume")
        self.gate.open()
        self._raise_if_dead()

    weight_update = "abort"
    """``server.weight_update`` as :meth:`set_weight_update` last set it (the fake behaves the
    same in every mode)."""

    async def set_weight_update(self, mode: str) -> None:
        """Record the mode, as a vLLM server switches it."""
        self.weight_update = mode

    async def wake_up(self) -> None:
        """Count the call (nothing to re-acquire)."""
        self._raise_if_dead()
        self.counts["wake_up"] += 1
        self.lifecycle.append("wake_up")

    async def sleep(self) -> None:
        """Count the call (nothing to release)."""
        self._raise_if_dead()
        self.counts["sleep"] += 1
        self.lifecycle.append("sleep")

    async def update_weights(
        self, named_tensors: Any, global_steps: int | None = None, **kwargs: Any
    ) -> None:
        """Count the call, keep the tensors in :attr:`weights` and set the version (default:
        previous + 1)."""
        self.counts["update_weights"] += 1
        self.lifecycle.append("update_weights")
        self.weights = dict(named_tensors)
        self.global_steps = self.global_steps + 1 if global_steps is None else int(global_steps)

    async def set_global_steps(self, global_steps: int) -> None:
        """Set the version put in replies."""
        self.global_steps = int(global_steps)

    async def begin_weight_update(self, global_steps: int | None = None, **kwargs: Any) -> None:
        """Open a streamed update (a second open one is a ServerError, as on a real server)."""
        self._raise_if_dead()
        while self._stalled:
            await asyncio.sleep(3600)
        if self._open_version is not None:
            raise ServerError(f"{self.name}: a weight update is already open")
        self.lifecycle.append("begin_weight_update")
        self._open_version = self.global_steps + 1 if global_steps is None else int(global_steps)
        self.buckets, self.weights = [], {}

    async def load_weight_bucket(self, bucket: WeightBucket) -> None:
        """Record the bucket's names and keep copies of its tensors in :attr:`weights`."""
        self._raise_if_dead()
        if self._open_version is None:
            raise ServerError(f"{self.name}: load_weight_bucket() without begin_weight_update()")
        self.buckets.append(list(bucket.names))
        self.weights.update({name: t.clone() for name, t in bucket.tensors()})

    async def finish_weight_update(self) -> dict[str, Any]:
        """Publish the version of the open update."""
        self._raise_if_dead()
        if self._open_version is None:
            raise ServerError(f"{self.name}: finish_weight_update() without begin_weight_update()")
        self.lifecycle.append("finish_weight_update")
        self.global_steps, self._open_version = self._open_version, None
        return {
            "version": self.global_steps, "tensors": len(self.weights),
            "buckets": len(self.buckets),
        }

    async def abort_weight_update(self) -> None:
        """Close an open streamed update without publishing its version (no-op when none is
        open)."""
        if self._open_version is not None:
            self.lifecycle.append("abort_weight_update")
            self._open_version = None

    async def clear_kv_cache(self) -> None:
        """No cache to clear; the call is counted."""
        self._raise_if_dead()
        self.counts["clear_kv_cache"] += 1

    async def start_profile(self, **kwargs: Any) -> None:
        """No profiler; the call is counted."""
        self.counts["start_profile"] += 1

    async def stop_profile(self) -> None:
        """No profiler; the call is counted."""
        self.counts["stop_profile"] += 1

    async def shutdown(self) -> None:
        """Nothing to stop."""
        return None
