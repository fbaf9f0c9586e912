"""What a wire format (dialect) of the gateway provides: parse a request, render a result, a stream
and errors.

Spec: docs/gateway.md#dialects.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from agentloop.gateway.protocol import GatewayHTTPError
from agentloop.gateway.turn import TurnEvent, TurnRequest, TurnResult


@dataclass(frozen=True)
class Dialect:
    """One wire format served on ``POST /sessions/{id}/v1{path}``.

    Attributes:
        name: ``chat``, ``responses`` or ``messages``.
        path: the route below ``/v1`` (``/chat/completions``, ``/responses``, ``/messages``).
        parse: ``(body, state) -> TurnRequest``; raises :class:`GatewayHTTPError` (4xx) for anything
        refused.
            ``state`` is this dialect's per-session dict (e.g. stored responses for
            ``previous_response_id``).
        render: ``(result, request, state) -> dict``: the non-streamed reply body.
        render_stream: ``(events, request, state) -> AsyncIterator[str]``: server-sent-event lines
            (``"event: …\\ndata: …\\n\\n"``); a :class:`GatewayHTTPError` raised by ``events`` is
            rendered as the dialect's in-stream error.
        error_body: ``(error) -> dict``: the error in this dialect's shape.
        parse_count: optional ``(body, state) -> TurnRequest`` for ``POST …/v1{path}/count_tokens``
        (the
            route exists when this and ``render_count`` are set).
        render_count: optional ``(prompt_tokens) -> dict``: the count_tokens reply body.
        openapi: optional ``openapi_extra`` of the route (its request-body schema).
    """

    name: str
    path: str
    parse: Callable[[Any, dict[str, Any]], TurnRequest]
    render: Callable[[TurnResult, TurnRequest, dict[str, Any]], dict[str, Any]]
    render_stream: Callable[
        [AsyncIterator[TurnEvent], TurnRequest, dict[str, Any]], AsyncIterator[str]
    ]
    error_body: Callable[[GatewayHTTPError], dict[str, Any]]
    parse_count: Callable[[Any, dict[str, Any]], TurnRequest] | None = None
    render_count: Callable[[int], dict[str, Any]] | None = None
    openapi: dict[str, Any] | None = None
