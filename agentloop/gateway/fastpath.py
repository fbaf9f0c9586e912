"""The gateway's fast path: its dialect routes as plain ASGI in front of FastAPI.

``POST /sessions/{id}/v1{path}`` (and the ``/v1/v1`` alias) for every dialect is most of a
gateway's traffic; :class:`FastPath` answers it exactly as the FastAPI route in
:mod:`agentloop.gateway.app` would (statuses, bodies, headers, request ids, errors in the dialect's
shape, logging, stream disconnects) without FastAPI's middleware stack, regex routing and
dependency solving per request.  :class:`GatewayApp` puts it in front of the FastAPI application,
which keeps every other route.  Numbers: docs/gateway.md#load.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from agentloop.gateway.dialects import DIALECTS, Dialect
from agentloop.gateway.protocol import GatewayHTTPError
from agentloop.gateway.service import GatewayService
from agentloop.gateway.wire import (
    check_declared_length,
    internal_error,
    key_from_headers,
    new_request_id,
    parse_body,
    too_large,
)

logger = logging.getLogger("agentloop.gateway.app")
"""The FastAPI routes' logger: a request's log lines read the same whichever path served it."""

_SESSIONS = "/sessions/"
_JSON_TYPE = (b"content-type", b"application/json")
_SSE_HEADERS = [
    (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
    (b"content-type", b"text/event-stream; charset=utf-8"),
]
"""The headers of a streamed reply (what Starlette's ``StreamingResponse`` sends for them)."""


def json_bytes(content: Any) -> bytes:
    """``content`` encoded as Starlette's ``JSONResponse`` encodes it (compact, UTF-8, no NaN)."""
    return json.dumps(
        content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")


class _Reply:
    """Writes one fast-path response to ``send``; ``started`` once its head is sent."""

    def __init__(self, send: Send, request_id: str) -> None:
        self.send = send
        self.rid = request_id.encode()
        self.started = False

    async def json(self, status: int, content: Any, *, id_first: bool = False) -> None:
        """A JSON response (the ``x-request-id`` header last, or first as for the 500)."""
        body = json_bytes(content)
        headers = [(b"content-length", str(len(body)).encode()), _JSON_TYPE]
        rid = (b"x-request-id", self.rid)
        self.started = True
        await self.send({"type": "http.response.start", "status": status,
                         "headers": [rid, *headers] if id_first else [*headers, rid]})
        await self.send({"type": "http.response.body", "body": body})

    async def stream(self, lines: AsyncIterator[str], receive: Receive) -> None:
        """Server-sent events from ``lines`` until they end or the client disconnects (then the
        pump is cancelled, which closes ``lines`` and so aborts the engine request)."""
        loop = asyncio.get_running_loop()
        pump = loop.create_task(self._pump(lines))
        listener = loop.create_task(_disconnected(receive))
        try:
            await asyncio.wait((pump, listener), return_when=asyncio.FIRST_COMPLETED)
        finally:
            listener.cancel()
            pump.cancel()  # a no-op once it is done
            await asyncio.wait((pump,))
        error = None if pump.cancelled() else pump.exception()
        if error is not None:
            raise error

    async def _pump(self, lines: AsyncIterator[str]) -> None:
        try:
            self.started = True
            await self.send({"type": "http.response.start", "status": 200,
                             "headers": [*_SSE_HEADERS, (b"x-request-id", self.rid)]})
            async for line in lines:
                await self.send(
                    {"type": "http.response.body", "body": line.encode("utf-8"), "more_body": True}
                )
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:  # also when cancelled between two lines (while a send waited)
            close = getattr(lines, "aclose", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has disconnected (or the response is complete)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class FastPath:
    """The dialect routes (``POST /sessions/{id}/v1{path}`` and the ``/v1/v1`` alias) as plain ASGI,
    answered as their FastAPI routes answer (same statuses, bodies, headers, request ids, errors
    in the dialect's shape, logging and stream disconnects), without FastAPI's middleware, routing
    and dependency solving per request.

    Args:
        service: the gateway's service.
        max_body_bytes: the request body limit (413 above it).
    """

    def __init__(self, service: GatewayService, max_body_bytes: int) -> None:
        self.service = service
        self.max_body_bytes = max_body_bytes
        self.routes: dict[str, Dialect] = {}
        """The part of a path after the session id -> its dialect."""
        for dialect in DIALECTS.values():
            self.routes[f"/v1{dialect.path}"] = dialect
            self.routes[f"/v1/v1{dialect.path}"] = dialect

    def match(self, scope: Scope) -> tuple[str, Dialect] | None:
        """``(session_id, dialect)`` when ``scope`` is a POST to a dialect route, else None."""
        if scope["type"] != "http" or scope["method"] != "POST" or scope.get("root_path"):
            return None
        path: str = scope["path"]
        if not path.startswith(_SESSIONS):
            return None
        slash = path.find("/", len(_SESSIONS))
        if slash <= len(_SESSIONS):  # no route after the id (-1), or an empty id
            return None
        dialect = self.routes.get(path[slash:])
        return None if dialect is None else (path[len(_SESSIONS):slash], dialect)

    async def __call__(self, scope: Scope, receive: Receive, send: Send, session_id: str,
                       dialect: Dialect) -> None:
        """Serve one matched request; an unhandled error is logged with the request id and
        answered 500 in the dialect's shape (once a stream began, only logged)."""
        rid = new_request_id()
        reply = _Reply(send, rid)
        try:
            try:
                result = await self._result(scope, receive, session_id, dialect, rid)
            except GatewayHTTPError as e:
                if e.request_id is None:
                    e.request_id = rid
                await reply.json(e.status, dialect.error_body(e))
                return
            if isinstance(result, dict):
                await reply.json(200, result)
            else:
                await reply.stream(result, receive)
        except Exception:
            logger.exception("request %s: unhandled error in %s %s", rid, scope.get("method"),
                             scope.get("path"))
            if not reply.started:  # a stream already began: nothing more can be said
                await reply.json(500, dialect.error_body(internal_error(rid)), id_first=True)

    async def _result(self, scope: Scope, receive: Receive, session_id: str, dialect: Dialect,
                      rid: str) -> dict[str, Any] | AsyncIterator[str]:
        """Key check, body, :meth:`GatewayService.handle` (in the FastAPI route's order)."""
        authorization = x_api_key = ""
        declared: str | None = None
        for name, value in scope["headers"]:
            if name == b"authorization" and not authorization:
                authorization = value.decode("latin-1")
            elif name == b"x-api-key" and not x_api_key:
                x_api_key = value.decode("latin-1")
            elif name == b"content-length" and declared is None:
                declared = value.decode("latin-1")
        self.service.session(session_id, key_from_headers(authorization, x_api_key),
                             check_key=True)
        check_declared_length(declared, self.max_body_bytes)
        body = parse_body(await _read_body(receive, self.max_body_bytes))
        return await self.service.handle(session_id, dialect, body, request_id=rid)


async def _read_body(receive: Receive, max_body_bytes: int) -> bytes:
    """The whole request body; 413 once it passes ``max_body_bytes``; ``ClientDisconnect`` when the
    client goes away first (as Starlette's ``Request.stream``)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > max_body_bytes:
                raise too_large(max_body_bytes)
            chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class GatewayApp(FastAPI):
    """The gateway's FastAPI application with a :class:`FastPath` in front (None: FastAPI
    only)."""

    fast_path: FastPath | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        fast = self.fast_path
        found = None if fast is None else fast.match(scope)
        if fast is None or found is None:
            await super().__call__(scope, receive, send)
        else:
            await fast(scope, receive, send, *found)
