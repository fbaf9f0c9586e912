"""The backend interface every inference server implements.

A server is a plain Python class; :mod:`agentloop.servers.placement` wraps it in a Ray actor.  The
router talks to it only through this Protocol, so vLLM, SGLang and the test fake
(:class:`agentloop.testing.ScriptedServer`) are interchangeable.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from agentloop.errors import ServerError
from agentloop.servers.weight_sync import WeightBucket
from agentloop.types import TokenDelta, TokenOutput


class ServerDeadError(ServerError):
    """A server can serve nothing more: its actor died, or its engine process did (the actor lives on).

    Servers raise it from ``generate`` once their engine is gone; the router raises it for a dead actor.
    The router then marks the server down, retries the request on another server (failover) and the
    AgentLoopManager restarts the server (see docs/faults.md).
    """

    def __init__(self, message: str, server: int | None = None) -> None:
        super().__init__(message)
        self.server = server

    def __reduce__(self) -> tuple[Any, ...]:  # keep ``server`` across Ray's pickling
        return (type(self), (str(self), self.server))


@runtime_checkable
class LLMServer(Protocol):
    """Token-in/token-out inference server."""

    supports_sleep: bool
    """Whether :meth:`sleep` really frees accelerator memory (False: a logged no-op)."""

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: list[Any] | None = None,
    ) -> TokenOutput:
        """Generate a continuation of ``prompt_ids``.

        ``sampling_params`` uses verl's keys: temperature, top_p, top_k, repetition_penalty,
        logprobs (bool), max_tokens, stop_token_ids, ignore_eos, seed.
        """
        ...

    def generate_stream(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: list[Any] | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """Like :meth:`generate`, yielding ids as they are sampled; the last chunk has ``finished=True``."""
        ...

    async def abort(self, request_id: str) -> None:
        """Abort an in-flight request; its ``generate`` returns with ``stop_reason='aborted'``."""
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
        """Open a streamed weight update (protocol in :mod:`agentloop.servers.weight_sync`): new requests wait
        until :meth:`finish_weight_update`; ``global_steps`` (default current + 1) is published at the end."""
        ...

    async def load_weight_bucket(self, bucket: WeightBucket) -> None:
        """Load one bucket of HF-named tensors into the open update."""
        ...

    async def finish_weight_update(self) -> dict[str, Any]:
        """Apply the update, reset the prefix cache, publish the version, resume; returns what was loaded."""
        ...

    async def abort_weight_update(self) -> None:
        """Close an open weight update without publishing its version (no-op when none is open)."""
        ...

    async def update_weights(self, named_tensors: Any, global_steps: int | None = None) -> Any:
        """The whole update in one call: ``named_tensors`` (HF checkpoint names → tensors) as one bucket."""
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


class BatchGenerateMixin:
    """``generate_batch``: many requests in one call, results streamed back as they finish.

    The router sends all requests a worker has ready for one server in a single Ray call (a streaming
    generator) instead of one actor call each; each yielded item is a list of ``(index, result)`` for
    the requests that finished since the previous item, where ``result`` is a TokenOutput or the
    ServerError the request raised.  Requires a ``generate`` coroutine with the LLMServer signature.
    """

    async def generate_batch(self, requests: list[dict[str, Any]]) -> AsyncIterator[list[tuple[int, Any]]]:
        """Run ``generate(**request)`` for every request concurrently; yield completions in groups."""
        import asyncio

        from agentloop.errors import ServerError

        done: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def one(i: int, request: dict[str, Any]) -> None:
            try:
                result: Any = await self.generate(**request)  # type: ignore[attr-defined]
            except Exception as e:  # noqa: BLE001 - sent back to the caller of this request only
                result = e if isinstance(e, ServerError) else ServerError(f"{type(e).__name__}: {e}")
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
