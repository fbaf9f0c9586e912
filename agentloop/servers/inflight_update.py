"""``rollout.server.weight_update``: what a weight update does to the requests running on a vLLM
server.

``abort`` (default; verl's fully-async ``partial_rollout``): the manager pauses the servers first
(:meth:`~agentloop.rollout.manager.AgentLoopManager.update_weights`), which cuts the running
requests; the routers re-issue them after the update with their tokens so far; on the server the
update then runs as a drain with nothing left to drain.  ``drain``: vLLM
``pause_generation(mode="wait")``: running requests finish on the old weights, new ones wait, the
prefix cache is reset.  ``keep`` (PipelineRL's in-flight update): ``pause_generation(mode="keep")``
freezes the running requests, the weights change, and they go on with the new weights on the KV
cache the old ones computed (prefix cache kept).  Each token's version is then known from the token
counts recorded at every switch while the engine is frozen (:meth:`InFlightUpdate.record_switch`,
read from vLLM's output processor), or, where a vLLM version lacks those, by following the
generation as a stream (:func:`collect_stream`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from agentloop.errors import ServerError
from agentloop.types import StopReason, TokenDelta, TokenOutput

WEIGHT_UPDATE_MODES = ("abort", "drain", "keep")


class InFlightUpdate:
    """The keep-mode part of a vLLM server: the current ``server.weight_update`` mode and, in keep
    mode, which weight version sampled each token of a generation that ran across updates.

    Args:
        mode: ``server.weight_update`` (one of :data:`WEIGHT_UPDATE_MODES`).
        server_index: for error messages.

    Raises:
        ServerError: ``mode`` is not a known mode.
    """

    def __init__(self, mode: str, server_index: int) -> None:
        if mode not in WEIGHT_UPDATE_MODES:
            raise ServerError(f"actor_rollout_ref.rollout.server.weight_update must be one of "
                              f"{', '.join(WEIGHT_UPDATE_MODES)}, not {mode!r}")
        self.server_index = server_index
        self.keep = mode == "keep"
        """``keep``: a weight update freezes the running requests instead of draining them; they go
        on with the new weights on the KV cache the old ones computed (per-token
        ``weight_versions``)."""
        self.counts_tokens = False
        """Whether the engine exposes per-request token counts (:meth:`record_switch`); set when
        it starts."""
        self.switches: dict[str, list[tuple[int, int]]] = {}
        """Request id -> (its tokens so far, the new version) at each keep-mode switch it ran
        across."""

    def set_mode(self, mode: str, busy: bool) -> None:
        """Switch the mode for later requests and updates (``abort`` and ``drain`` are the same on
        the server: the manager pauses first for abort).

        Raises:
            ServerError: an unknown mode, or ``busy`` (a request runs or an update is open: a
            request's mode is
                fixed when it starts).
        """
        if mode not in WEIGHT_UPDATE_MODES:
            raise ServerError(
                f"weight_update must be one of {', '.join(WEIGHT_UPDATE_MODES)}, not {mode!r}"
            )
        if busy:
            raise ServerError(
                f"vLLM server {self.server_index}: cannot switch "
                f"weight_update while requests run or "
                "an update is open"
            )
        self.keep = mode == "keep"

    def follows_stream(self) -> bool:
        """Whether ``generate`` must run as a stream to know its tokens' versions (keep mode, no
        token counts)."""
        return self.keep and not self.counts_tokens

    def versioned(self, extra: dict[str, Any], versions: list[int]) -> dict[str, Any]:
        """``extra`` with the per-token ``weight_versions`` and their range (keep mode; else
        ``extra``)."""
        if not self.keep or not versions:
            return extra
        return {**extra, "weight_versions": versions, "min_global_steps": min(versions),
                "max_global_steps": max(versions)}

    def token_versions(self, request_id: str, started_at: int, n: int) -> list[int]:
        """The weight version of each of a finished generation's ``n`` tokens (it started on
        ``started_at``), from the token counts recorded at each switch it ran across; forgets the
        request's switches."""
        versions: list[int] = []
        current = started_at
        for count, version in self.switches.pop(request_id, []):
            versions += [current] * max(0, min(count, n) - len(versions))
            current = version
        return versions + [current] * (n - len(versions))

    def forget(self, request_id: str) -> None:
        """Drop a request's switches (a stream tags its tokens as they come)."""
        self.switches.pop(request_id, None)

    def record_switch(self, engine: Any, version: int) -> None:
        """At a keep-mode update, with the engine frozen: how many tokens each running generation
        has, so :meth:`token_versions` can tell the old version's tokens from the new one's
        (FINAL_ONLY outputs carry no per-step record).  Reads vLLM's output processor (the request
        states it keeps per request).
        """
        for state in list(engine.output_processor.request_states.values()):
            rid = getattr(state, "external_req_id", None) or state.request_id
            count = (
                int(state.detokenizer.num_output_tokens()) if state.detokenizer is not None else 0
            )
            self.switches.setdefault(rid, []).append((count, version))


async def collect_stream(deltas: AsyncIterator[TokenDelta], want_logprobs: bool) -> TokenOutput:
    """One TokenOutput from a generation's stream: the ids and log-probs joined, the last chunk's
    stop reason, extras and control signals (``generate`` through ``generate_stream``, so each
    token's version is known)."""
    ids: list[int] = []
    log_probs: list[float] | None = [] if want_logprobs else None
    last: TokenDelta | None = None
    async for delta in deltas:
        ids += delta.token_ids
        if log_probs is not None:
            log_probs += delta.log_probs or []
        last = delta
    assert last is not None and last.finished
    return TokenOutput(
        token_ids=ids, log_probs=log_probs, stop_reason=last.stop_reason or StopReason.STOP,
        stop_sequence=last.stop_sequence, extra_fields=last.extra_fields,
        preempted_by_pause=last.preempted_by_pause, cut_by_update=last.cut_by_update,
        max_tokens=last.max_tokens, routed_experts=last.routed_experts,
        routed_experts_start=last.routed_experts_start,
    )
