"""The backend interface every inference server implements.

A server is a plain Python class; :mod:`agentloop.servers.placement` wraps it in a Ray actor.  The
router talks to it only through this Protocol, so vLLM, SGLang and the test fake
(:class:`agentloop.testing.ScriptedServer`) are interchangeable.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from agentloop.types import TokenDelta, TokenOutput


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

    async def update_weights(self, named_tensors: dict[str, Any]) -> None:
        """Replace the served model's weights with ``named_tensors`` (HF checkpoint names)."""
        ...
