"""The backend interface every inference server implements.

A server is a plain Python class; :mod:`agentloop.cluster.placement` wraps it in a Ray actor.  The
router talks to it only through this Protocol, so vLLM, SGLang and the test fake
(:class:`agentloop.testing.ScriptedServer`) are interchangeable.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypedDict, runtime_checkable

from agentloop.errors import ServerError
from agentloop.servers.weight_sync import OpenWeightUpdate, WeightBucket, Weights, iter_buckets
from agentloop.types import StopReason, TokenDelta, TokenOutput

LOST_FOR_UPDATE = (
    "the weight update goes on without this server, which is restarted and "
    "loads the weights at the "
    "next update"
)
"""How a :class:`ServerDeadError` raised by a weight-update step ends (the manager's side:
ServerSupervisor)."""
GOES_ON_WITHOUT = "{} goes on without this server, which is restarted"
"""How a :class:`ServerDeadError` raised by a server-wide call (pause, sleep, ...) ends:
``.format(call)``."""


class ServerDeadError(ServerError):
    """A server can serve nothing more: its actor died, or its engine process did (the actor lives
    on).

    Servers raise it from ``generate`` once their engine is gone; the router raises it for a dead
    actor. The router then marks the server down, retries the request on another server (failover)
    and the AgentLoopManager restarts the server (see docs/faults.md).
    """

    def __init__(self, message: str, server: int | None = None) -> None:
        super().__init__(message)
        self.server = server

    def __reduce__(self) -> tuple[Any, ...]:  # keep ``server`` across Ray's pickling
        return (type(self), (str(self), self.server))


@runtime_checkable
class LLMServer(Protocol):
    """Token-in/token-out inference server: the methods the router and the manager call (as Ray
    actor methods).

    Optional: ``generate_batch(requests)`` (an async generator, see :class:`GenerateBatcher`; the
    router uses it for server actors), ``busy_seconds()`` (see :meth:`PauseGate.busy_seconds`),
    ``check_health()``, ``set_weight_update(mode)``.  agentloop's servers are built from parts held
    as attributes: ``batcher`` (:class:`GenerateBatcher`), ``gate`` (:class:`PauseGate`),
    ``weights`` (a :class:`WeightLoader`) and, on vLLM, ``inflight`` (keep-mode updates).
    """

    supports_sleep: bool
    """Whether :meth:`sleep` really frees accelerator memory (False: a logged no-op)."""

    async def generate(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
        image_data: list[Any] | None = None,
    ) -> TokenOutput:
        """Generate a continuation of ``prompt_ids``.

        ``sampling_params`` uses verl's keys: temperature, top_p, top_k, repetition_penalty,
        logprobs (bool), max_tokens, stop_token_ids, ignore_eos, seed.
        """
        ...

    def generate_stream(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
        image_data: list[Any] | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """Like :meth:`generate`, yielding ids as they are sampled; the last chunk has
        ``finished=True``."""
        ...

    async def abort(self, request_id: str) -> None:
        """Abort an in-flight request; its ``generate`` returns with ``stop_reason='aborted'``."""
        ...

    async def pause(self, for_update: bool = False) -> int:
        """Abort every in-flight request and hold new ``generate`` calls until :meth:`resume`;
        returns how many requests were in flight.  Each aborted call returns the tokens and
        log-probs sampled before the abort, ``stop_reason='aborted'``, ``preempted_by_pause=True``
        and ``max_tokens`` (the limit it ran under; typed fields of TokenOutput, see
        :meth:`PauseGate.signals`), so the router can resume it (``partial_rollout``).
        ``for_update`` (a weight update with ``server.weight_update: abort``) also sets
        ``cut_by_update``: the router resumes those whatever ``partial_rollout`` says.  A weight
        update may run while paused; held calls still wait for :meth:`resume`.  Pausing a paused
        server returns 0."""
        ...

    async def resume(self) -> None:
        """Let held and new requests run again (no-op when not paused)."""
        ...

    async def wake_up(self) -> None:
        """Re-acquire memory released by :meth:`sleep`."""
        ...

    async def sleep(self) -> None:
        """Release KV cache (and weights) memory between rollout phases."""
        ...

    global_steps: int
    """Version of the weights being served (0 before any update); every TokenOutput (and the final
    TokenDelta) carries it as ``extra_fields["global_steps"]``."""

    async def set_global_steps(self, global_steps: int) -> None:
        """Set the weight version without loading weights (verl's server method)."""
        ...

    async def begin_weight_update(self, global_steps: int | None = None) -> None:
        """Open a streamed weight update (protocol in :mod:`agentloop.servers.weight_sync`): new
        requests wait until :meth:`finish_weight_update`; ``global_steps`` (default current + 1) is
        published at the end."""
        ...

    async def load_weight_bucket(self, bucket: WeightBucket) -> None:
        """Load one bucket of HF-named tensors into the open update."""
        ...

    async def finish_weight_update(self) -> dict[str, Any]:
        """Apply the update, reset the prefix cache, publish the version, resume; returns what
        was loaded."""
        ...

    async def abort_weight_update(self) -> None:
        """Close an open weight update without publishing its version (no-op when none is open)."""
        ...

    async def update_weights(self, named_tensors: Any, global_steps: int | None = None) -> Any:
        """The whole update in one call: ``named_tensors`` (HF checkpoint names → tensors) as one
        bucket."""
        ...

    async def clear_kv_cache(self) -> None:
        """Drop the prefix (KV) cache."""
        ...

    async def start_profile(self, **kwargs: Any) -> None:
        """Start the engine's profiler (a logged no-op where it has none)."""
        ...

    async def stop_profile(self) -> None:
        """Stop the profiler and write its trace."""
        ...


GenerateFn = Callable[..., Awaitable[Any]]
"""A server's ``generate`` coroutine function (the LLMServer signature, called with keywords)."""


class GenerateBatcher:
    """A server's ``generate_batch``: many requests in one call, results streamed back as they
    finish.

    The router sends all requests a worker has ready for one server in a single Ray call (a
    streaming generator) instead of one actor call each; each yielded item is a list of
    ``(index, result)`` for the requests that finished since the previous item, where ``result`` is
    a TokenOutput or the ServerError the request raised.

    Args:
        generate: the server's ``generate`` (LLMServer signature), run once per request.
    """

    def __init__(self, generate: GenerateFn) -> None:
        self.generate = generate

    async def run(self, requests: list[dict[str, Any]]) -> AsyncIterator[list[tuple[int, Any]]]:
        """Run ``generate(**request)`` for every request concurrently; yield completions in groups.
        A request that raises yields its error (a ServerError; any other exception wrapped in one).
        """
        done: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def one(i: int, request: dict[str, Any]) -> None:
            try:
                result: Any = await self.generate(**request)
            except Exception as e:  # noqa: BLE001 - sent back to the caller of this request only
                result = (
                    e if isinstance(e, ServerError) else ServerError(f"{type(e).__name__}: {e}")
                )
            done.put_nowait((i, result))

        tasks = [asyncio.ensure_future(one(i, r)) for i, r in enumerate(requests)]
        try:
            remaining = len(requests)
            while remaining:
                group = [await done.get()]
                while not done.empty():
                    group.append(done.get_nowait())
                remaining -= len(group)
                yield group
        finally:
            for task in tasks:
                task.cancel()


@runtime_checkable
class WeightLoader(Protocol):
    """The weight-loading part of a server (``server.weights``): what the server's weight-update
    actor methods delegate to.  Implementations:
    :class:`agentloop.servers.vllm_weights.VLLMWeights`,
    :class:`agentloop.servers.sglang_weights.SGLangWeights`."""

    version: int
    """Version of the weights being served (the server's ``global_steps``)."""
    open: OpenWeightUpdate | None
    """The open update, None between updates."""

    async def begin(self, global_steps: int | None = None, transport: str = "auto") -> None:
        """Open an update (``begin_weight_update``); raises ServerError when one is open."""
        ...

    async def load(self, bucket: WeightBucket) -> None:
        """Load one bucket into the open update (``load_weight_bucket``)."""
        ...

    async def finish(self) -> dict[str, Any]:
        """Apply the update and publish its version; returns what was loaded
        (``finish_weight_update``)."""
        ...

    async def abort(self) -> None:
        """Close the open update without publishing its version (``abort_weight_update``)."""
        ...



async def load_whole(loader: WeightLoader, named_tensors: Weights, global_steps: int | None = None,
                     transport: str = "auto") -> dict[str, Any]:
    """A whole weight update in one call (a server's ``update_weights``): begin, every tensor as one
    bucket, finish; returns :meth:`WeightLoader.finish`'s result."""
    await loader.begin(global_steps, transport)
    for bucket in iter_buckets(named_tensors, bucket_bytes=1 << 62):
        await loader.load(bucket)
    return await loader.finish()


class CutSignals(TypedDict, total=False):
    """The control fields a pause sets on an output it cut (:meth:`PauseGate.signals`): keyword
    updates for a :class:`~agentloop.types.TokenOutput` or :class:`~agentloop.types.TokenDelta`."""

    preempted_by_pause: bool
    cut_by_update: bool
    max_tokens: int


class PauseGate:
    """The bookkeeping behind a server's :meth:`LLMServer.pause` / :meth:`LLMServer.resume`.

    ``generate`` runs inside :meth:`admitted`: it waits there while the gate is closed, then counts
    as in flight. :meth:`close` (pause) remembers which in-flight requests it preempts; the server
    aborts them in its engine and sets each output's control fields from :meth:`signals`, which tags
    a preempted, aborted output for the router.  A caller's own abort (:meth:`caller_abort`) is
    never tagged: the router resumes only what a pause interrupted.  :meth:`busy_seconds` is the
    server's ``busy_seconds`` actor method.
    """

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.in_flight: dict[str, int] = {}
        """Request ids admitted and not finished -> how many calls use the id."""
        self._waiting: dict[str, int] = {}
        self._preempted: dict[str, bool] = {}
        """Request ids a pause cut -> whether it was a weight update's
        (``server.weight_update: abort``)."""
        self._dropped: set[str] = set()
        self._busy_total = 0.0
        self._busy_since: float | None = None

    def busy_seconds(self) -> float:
        """Seconds (monotonic clock) during which at least one admitted request was in the engine,
        since the server started: the numerator of the engine-busy fraction (requests held by a
        pause do not count)."""
        running = time.monotonic() - self._busy_since if self._busy_since is not None else 0.0
        return self._busy_total + running

    @property
    def paused(self) -> bool:
        """Whether new requests are held."""
        return not self._open.is_set()

    def admitted(self, request_id: str) -> _Admission:
        """``async with gate.admitted(request_id) as admitted``: wait while paused, then count
        ``request_id`` in flight until the block ends.  ``admitted`` is False when the caller
        aborted the request while it was held (it must not reach the engine then).  A plain class,
        not a generator-based context manager: it runs once per engine call."""
        return _Admission(self, request_id)

    async def _enter(self, request_id: str) -> bool:
        _count(self._waiting, request_id, +1)
        try:
            while not self._open.is_set():
                await self._open.wait()
        finally:  # also when the wait is cancelled: a later call with this id must not be dropped
            _count(self._waiting, request_id, -1)
            admitted = request_id not in self._dropped
            if request_id not in self._waiting:
                self._dropped.discard(request_id)
        self._count_in(request_id)
        return admitted

    def _enter_open(self, request_id: str) -> bool:
        """:meth:`_enter` while the gate is open (nothing to wait for), without a coroutine."""
        admitted = request_id not in self._dropped
        if not admitted and request_id not in self._waiting:
            self._dropped.discard(request_id)
        self._count_in(request_id)
        return admitted

    def _count_in(self, request_id: str) -> None:
        if not self.in_flight:
            self._busy_since = time.monotonic()
        _count(self.in_flight, request_id, +1)

    def _exit(self, request_id: str) -> None:
        _count(self.in_flight, request_id, -1)
        if request_id not in self.in_flight:
            self._preempted.pop(request_id, None)
        if not self.in_flight and self._busy_since is not None:
            self._busy_total += time.monotonic() - self._busy_since
            self._busy_since = None

    def close(self, for_update: bool = False) -> int:
        """Hold new requests and mark the in-flight ones preempted (``for_update``: by a weight
        update); returns how many calls were in flight (0 when already closed)."""
        if not self._open.is_set():
            return 0
        self._open.clear()
        self._preempted.update(dict.fromkeys(self.in_flight, for_update))
        return sum(self.in_flight.values())

    def open(self) -> None:
        """Let held and new requests go."""
        self._open.set()

    def caller_abort(self, request_id: str) -> None:
        """The caller aborted ``request_id``: not a preemption; if it is held, it must not run."""
        self._preempted.pop(request_id, None)
        if request_id in self._waiting:
            self._dropped.add(request_id)

    def signals(
        self, stop_reason: str | None, request_id: str, max_tokens: int | None
    ) -> CutSignals:
        """The control fields for an output ending with ``stop_reason``: ``preempted_by_pause`` (+
        ``cut_by_update`` for a weight update's pause, + ``max_tokens`` when known) when a pause,
        not the caller, aborted it; else none.  What the router needs to resume it."""
        if stop_reason != StopReason.ABORTED or request_id not in self._preempted:
            return {}
        signals: CutSignals = {"preempted_by_pause": True}
        if self._preempted[request_id]:
            signals["cut_by_update"] = True
        if max_tokens is not None:
            signals["max_tokens"] = int(max_tokens)
        return signals


class _Admission:
    """The context manager :meth:`PauseGate.admitted` returns."""

    __slots__ = ("gate", "request_id")

    def __init__(self, gate: PauseGate, request_id: str) -> None:
        self.gate, self.request_id = gate, request_id

    async def __aenter__(self) -> bool:
        gate = self.gate
        if gate._open.is_set():  # the usual case: admitted at once, one coroutine less per call
            return gate._enter_open(self.request_id)
        return await gate._enter(self.request_id)

    async def __aexit__(self, *exc: object) -> None:
        self.gate._exit(self.request_id)


def _count(counts: dict[str, int], key: str, step: int) -> None:
    left = counts.get(key, 0) + step
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
