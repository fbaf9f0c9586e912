"""What the router does to a server's outputs before a caller sees them.

:func:`with_versions` tags an output's ``extra_fields`` with the routed server and its
weight-version range; :func:`join_pieces` makes one ``TokenOutput`` of the pieces of a generation
a server pause cut and the router resumed; :data:`UNCUT` clears a handled piece's cut signals;
:func:`trace_generate` records one ``generate`` span per engine call.  Used by
:class:`agentloop.routing.manager.AsyncLLMServerManager`; spec: docs/routing.md and docs/async.md.
"""

from __future__ import annotations

from typing import Any

from agentloop.batch.routed_experts import join_routed_experts
from agentloop.report import timing
from agentloop.trace import decode_tokens, record_span
from agentloop.types import TokenOutput

UNCUT: dict[str, Any] = {"preempted_by_pause": False, "cut_by_update": False, "max_tokens": None}
"""The control fields of a piece the router has handled: never passed on as a cut (TokenOutput's
defaults)."""


def with_versions(extra_fields: dict[str, Any], server: int) -> dict[str, Any]:
    """A copy of a server's ``extra_fields`` with the routed ``server_index`` and, when the server
    reports a weight version (``global_steps``), ``min_global_steps`` / ``max_global_steps``
    defaulting to it, as verl's client sets them (a caller that merges several calls narrows them to
    the range it saw)."""
    fields = {**extra_fields, "server_index": server}
    if "global_steps" in fields:
        fields.setdefault("min_global_steps", fields["global_steps"])
        fields.setdefault("max_global_steps", fields["global_steps"])
    return fields


def trace_generate(
    request_id: str, server: int, start: float, prompt_ids: list[int], output: TokenOutput
) -> None:
    """One ``generate`` span per engine call (``rollout.trace``); decoded text with
    ``token2text``."""
    outputs: dict[str, Any] = {
        "response_tokens": len(output.token_ids),
        "stop_reason": getattr(output.stop_reason, "value", output.stop_reason),
        "global_steps": output.extra_fields.get("global_steps"),
    }
    text = decode_tokens(output.token_ids)
    if text is not None:
        outputs["response_text"] = text
    record_span(
        "generate",
        inputs={"request_id": request_id, "server": server, "prompt_tokens": len(prompt_ids)},
        outputs=outputs, start=start, end=timing.now(), attrs={"server": server},
    )


def join_pieces(pieces: list[TokenOutput]) -> TokenOutput:
    """One TokenOutput from the pieces of a resumed generation (see
    AsyncLLMServerManager.generate)."""
    last = pieces[-1]
    fields = dict(last.extra_fields)
    signals: dict[str, Any] = (
        {} if last.preempted_by_pause else {"cut_by_update": False, "max_tokens": None}
    )
    if all(p.extra_fields.get("global_steps") is not None for p in pieces):
        versions = [int(p.extra_fields["global_steps"]) for p in pieces]
        # a piece cut before its first token sampled nothing with its weights: it does not widen
        # the range; a piece may span an update
        per_token = [p.extra_fields.get("weight_versions") or [v] * len(p.token_ids)
                     for p, v in zip(pieces, versions, strict=True)]  # (server.weight_update: keep)
        sampled = [v for vs in per_token for v in vs] or versions
        fields["min_global_steps"] = min(sampled)
        fields["max_global_steps"] = max(sampled)
        fields["weight_versions"] = [v for vs in per_token for v in vs]
    if len(pieces) == 1:
        return last.model_copy(update={"extra_fields": fields, **signals})
    log_probs = (
        None
        if any(p.log_probs is None for p in pieces)
        else [x for p in pieces for x in p.log_probs or []]
    )
    return last.model_copy(update={
        "token_ids": [t for p in pieces for t in p.token_ids], "log_probs": log_probs,
        "num_preempted": len(pieces) - 1, "extra_fields": fields, **signals,
        **join_routed_experts(pieces)})
