"""``rollout.server.weight_update``: what a weight update does to the requests running on a vLLM server.

``abort`` (default; verl's fully-async ``partial_rollout``): the manager pauses the servers first
(:meth:`~agentloop.manager.AgentLoopManager.update_weights`), which cuts the running requests; the routers re-issue
them after the update with their tokens so far; on the server the update then runs as a drain with nothing left to
drain.  ``drain``: vLLM ``pause_generation(mode="wait")``: running requests finish on the old weights, new ones
wait, the prefix cache is reset.  ``keep`` (PipelineRL's in-flight update): ``pause_generation(mode="keep")``
freezes the running requests, the weights change, and they go on with the new weights on the KV cache the old
ones computed (prefix cache kept).  Each token's version is then known from the token counts recorded at every
switch while the engine is frozen (:meth:`InFlightUpdateMixin._record_switch`, read from vLLM's output
processor), or, where a vLLM version lacks those, by following the generation as a stream.
"""

from __future__ import annotations

from typing import Any

from agentloop.errors import ServerError
from agentloop.types import StopReason, TokenDelta, TokenOutput

WEIGHT_UPDATE_MODES = ("abort", "drain", "keep")


class InFlightUpdateMixin:
    """Keep-mode bookkeeping for :class:`agentloop.servers.vllm.VLLMServer` (its ``engine``, ``_gate``,
    ``_update``, ``global_steps`` and ``generate_stream``)."""

    engine: Any
    _gate: Any
    _update: Any
    server_index: int
    keep_kv_on_update: bool
    _switches: dict[str, list[tuple[int, int]]]
    generate_stream: Any

    async def set_weight_update(self, mode: str) -> None:
        """Switch ``server.weight_update`` (``abort`` | ``drain`` | ``keep``; abort and drain are the same here, the
        manager pauses first for abort) for later requests and updates; refused while a request runs or an update is
        open (a request's mode is fixed when it starts)."""
        if mode not in WEIGHT_UPDATE_MODES:
            raise ServerError(f"weight_update must be one of {', '.join(WEIGHT_UPDATE_MODES)}, not {mode!r}")
        if self._update is not None or self._gate.in_flight:
            raise ServerError(f"vLLM server {self.server_index}: cannot switch weight_update while requests run or "
                              "an update is open")
        self.keep_kv_on_update = mode == "keep"

    async def _generate_streamed(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                                 image_data: list[Any] | None, video_data: list[Any] | None) -> TokenOutput:
        """:meth:`generate` through :meth:`generate_stream`, so each token's weight version is known."""
        ids: list[int] = []
        log_probs: list[float] | None = [] if sampling_params.get("logprobs") else None
        last: TokenDelta | None = None
        async for delta in self.generate_stream(prompt_ids, sampling_params, request_id, image_data, video_data):
            ids += delta.token_ids
            if log_probs is not None:
                log_probs += delta.log_probs or []
            last = delta
        assert last is not None and last.finished
        return TokenOutput(token_ids=ids, log_probs=log_probs, stop_reason=last.stop_reason or StopReason.STOP,
                           extra_fields=last.extra_fields)

    def _versioned(self, extra: dict[str, Any], versions: list[int]) -> dict[str, Any]:
        """``extra`` with the per-token ``weight_versions`` and their range (``server.weight_update: keep``)."""
        if not self.keep_kv_on_update or not versions:
            return extra
        return {**extra, "weight_versions": versions, "min_global_steps": min(versions),
                "max_global_steps": max(versions)}

    def _token_versions(self, request_id: str, started_at: int, n: int) -> list[int]:
        """The weight version of each of a finished generation's ``n`` tokens, from the token counts recorded at
        each keep-mode switch it ran across (:meth:`_record_switch`)."""
        versions: list[int] = []
        current = started_at
        for count, version in self._switches.pop(request_id, []):
            versions += [current] * max(0, min(count, n) - len(versions))
            current = version
        return versions + [current] * (n - len(versions))

    def _record_switch(self, version: int) -> None:
        """At a keep-mode update, with the engine frozen: how many tokens each running generation has, so
        :meth:`_token_versions` can tell the old version's tokens from the new one's (FINAL_ONLY outputs carry no
        per-step record).  Reads vLLM's output processor (the request states it keeps per request)."""
        for state in list(self.engine.output_processor.request_states.values()):
            rid = getattr(state, "external_req_id", None) or state.request_id
            count = int(state.detokenizer.num_output_tokens()) if state.detokenizer is not None else 0
            self._switches.setdefault(rid, []).append((count, version))
