"""ScriptedServer: a fake inference engine for unit tests (no Ray, no torch, no model).

It implements :class:`agentloop.servers.base.LLMServer`, so agent loops, the router and workers
run against it exactly as against vLLM.  Use it in your own tests::

    server = ScriptedServer([[11, 12, 2], RuntimeError("boom")], eos_token_id=2)
    manager = AsyncLLMServerManager([server])
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from agentloop.errors import ServerError
from agentloop.types import StopReason, TokenOutput

Script = list[int] | TokenOutput | Exception


class ScriptedServer:
    """Replies from a script.

    Args:
        responses: a list consumed in order (token id lists, TokenOutputs, or Exceptions to raise), or
            a callable ``(prompt_ids, sampling_params, request_id) -> list[int] | TokenOutput``; None
            echoes the last ``min(4, max_tokens)`` prompt ids.
        eos_token_id: a reply ending with it has ``stop_reason='stop'``.
        delay: seconds to wait before replying (lets tests overlap requests).
        name: shown in error messages.
    """

    supports_sleep = True

    def __init__(
        self,
        responses: Sequence[Script] | Callable[[list[int], dict[str, Any], str], Any] | None = None,
        *,
        eos_token_id: int | None = None,
        delay: float = 0.0,
        name: str = "scripted",
    ) -> None:
        self._script = responses if callable(responses) or responses is None else list(responses)
        self._next = 0
        self.eos_token_id = eos_token_id
        self.delay = delay
        self.name = name
        self.calls: list[dict[str, Any]] = []
        self.counts = {"wake_up": 0, "sleep": 0, "update_weights": 0, "abort": 0}
        self.weights: dict[str, Any] = {}
        self._aborted: set[str] = set()

    def _reply(self, prompt_ids: list[int], params: dict[str, Any], request_id: str) -> Any:
        if self._script is None:
            return list(prompt_ids[-min(4, int(params.get("max_tokens") or 4)):])
        if callable(self._script):
            return self._script(list(prompt_ids), params, request_id)
        if self._next >= len(self._script):
            raise ServerError(
                f"{self.name}: script exhausted after {len(self._script)} replies (request {request_id!r})"
            )
        reply = self._script[self._next]
        self._next += 1
        return reply

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: list[Any] | None = None,
    ) -> TokenOutput:
        """Record the call, wait ``delay``, then reply from the script."""
        self.calls.append({"request_id": request_id, "prompt_ids": list(prompt_ids),
                           "sampling_params": dict(sampling_params), "image_data": image_data})
        if self.delay:
            await asyncio.sleep(self.delay)
        if request_id in self._aborted:
            self._aborted.discard(request_id)
            return TokenOutput(token_ids=[], stop_reason=StopReason.ABORTED)
        reply = self._reply(prompt_ids, sampling_params, request_id)
        if isinstance(reply, Exception):
            raise reply
        if isinstance(reply, TokenOutput):
            return reply
        return self._shape(list(reply), sampling_params)

    def _shape(self, ids: list[int], params: dict[str, Any]) -> TokenOutput:
        stop = StopReason.STOP
        max_tokens = params.get("max_tokens")
        if max_tokens is not None and len(ids) > int(max_tokens):
            ids, stop = ids[: int(max_tokens)], StopReason.LENGTH
        elif self.eos_token_id is not None and (not ids or ids[-1] != self.eos_token_id) and max_tokens is not None:
            stop = StopReason.LENGTH if len(ids) == int(max_tokens) else StopReason.STOP
        log_probs = [-0.1 * ((i % 10) + 1) for i in range(len(ids))] if params.get("logprobs") else None
        return TokenOutput(token_ids=ids, log_probs=log_probs, stop_reason=stop, num_preempted=0)

    async def abort(self, request_id: str) -> None:
        """The pending (or next) call with this id returns ``aborted`` with no tokens."""
        self.counts["abort"] += 1
        self._aborted.add(request_id)

    async def wake_up(self) -> None:
        self.counts["wake_up"] += 1

    async def sleep(self) -> None:
        self.counts["sleep"] += 1

    async def update_weights(self, named_tensors: dict[str, Any]) -> None:
        self.counts["update_weights"] += 1
        self.weights = dict(named_tensors)

    async def shutdown(self) -> None:
        return None
