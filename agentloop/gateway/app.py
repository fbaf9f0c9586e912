"""The gateway's HTTP surface (FastAPI) over a :class:`~agentloop.gateway.service.GatewayService`.

Routes: one ``POST /sessions/{id}/v1{path}`` per dialect
(:data:`agentloop.gateway.dialects.DIALECTS`: ``/chat/completions``, …; streaming or not; also under
``/sessions/{id}/v1/v1``), ``GET /sessions/{id}/v1/models``, ``POST /sessions/{id}/complete`` and
``GET /health``; every session route needs the session's api_key as ``Authorization: Bearer <key>``
or ``x-api-key: <key>``.  Errors carry a request id (also in every response's ``x-request-id``
header), in the shape of the dialect whose route was hit (OpenAI's elsewhere): 4xx for the client's
faults, 5xx only for the gateway's own (details only in the server log line ``request <id>: ...``).
The dialect routes go through :class:`FastPath`, a plain ASGI handler in front of FastAPI that
answers them byte for byte as the FastAPI routes would, without FastAPI's per-request stack
(docs/gateway.md#load); everything else is FastAPI's.
Spec (every status code): docs/gateway.md#http-api."""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentloop.config.build import read_value
from agentloop.gateway.dialects import DIALECTS, Dialect, dialect_for_path
from agentloop.gateway.fastpath import FastPath, GatewayApp
from agentloop.gateway.protocol import GatewayHTTPError
from agentloop.gateway.service import GatewayService
from agentloop.gateway.wire import (
    MAX_JSON_DEPTH as MAX_JSON_DEPTH,
)
from agentloop.gateway.wire import (
    check_declared_length,
    internal_error,
    key_from_headers,
    new_request_id,
    parse_body,
    too_large,
)
from agentloop.gateway.wire import (
    decode_json as decode_json,
)
from agentloop.gateway.wire import (
    json_depth_over as json_depth_over,
)

DEFAULT_MAX_BODY_BYTES: int = read_value(None, "actor_rollout_ref.rollout.gateway.max_body_bytes")
"""The YAML's ``gateway.max_body_bytes`` (8 MiB): :func:`build_app`'s default."""

logger = logging.getLogger(__name__)


def _error(e: GatewayHTTPError, request: Request | None = None) -> JSONResponse:
    """``e`` as a response, in the error shape of the dialect whose route ``request`` hit (else
    OpenAI's)."""
    dialect = None if request is None else dialect_for_path(request.url.path)
    body = e.body() if dialect is None else dialect.error_body(e)
    return JSONResponse(status_code=e.status, content=body)


async def read_json(request: Request, max_body_bytes: int, *, required: bool = True) -> Any:
    """The decoded JSON body; 413 above the limit (checked while reading), 400 when not JSON."""
    check_declared_length(request.headers.get("content-length"), max_body_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise too_large(max_body_bytes)
        chunks.append(chunk)
    return parse_body(b"".join(chunks), required=required)


def _api_key(request: Request) -> str | None:
    """The session key: ``Authorization: Bearer <key>`` (OpenAI SDKs) or ``x-api-key: <key>``
    (Anthropic's)."""
    headers = request.headers
    return key_from_headers(headers.get("authorization", ""), headers.get("x-api-key", ""))


_COMPLETE_OPENAPI = {"requestBody": {"required": False, "content": {"application/json": {"schema": {
    "type": "object", "properties": {"reward_info": {"type": "object"}}}}}}}


def request_id_of(request: Request) -> str:
    """The id :class:`RequestIdMiddleware` gave this request."""
    return str(request.scope.get("state", {}).get("request_id") or new_request_id())


class RequestIdMiddleware:
    """Gives every HTTP request an id (``x-request-id`` response header,
    ``request.state.request_id``) and turns an exception nothing else handled into a 500 with that
    id; the traceback goes to the log only."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = new_request_id()
        scope.setdefault("state", {})["request_id"] = rid
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception(
                "request %s: unhandled error in %s %s", rid, scope.get("method"), scope.get("path")
            )
            if started:  # a stream already began: nothing more can be said to the client
                return
            error = internal_error(rid)
            dialect = dialect_for_path(str(scope.get("path", "")))
            body = error.body() if dialect is None else dialect.error_body(error)
            await JSONResponse(status_code=500, content=body, headers={"x-request-id": rid})(
                scope, receive, send
            )


def build_app(
    service: GatewayService, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    fast_path: bool = True,
) -> GatewayApp:
    """The application of one gateway: FastAPI, with the dialect routes served by
    :class:`FastPath` in front of it unless ``fast_path`` is false (the FastAPI routes then answer
    them; same responses)."""
    app = GatewayApp(title="agentloop gateway", version="1")
    if fast_path:
        app.fast_path = FastPath(service, max_body_bytes)
    app.add_middleware(RequestIdMiddleware)

    @app.exception_handler(GatewayHTTPError)
    async def _gateway_error(request: Request, e: GatewayHTTPError) -> JSONResponse:
        if e.request_id is None:
            e.request_id = request_id_of(request)
        return _error(e, request)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return _error(
            GatewayHTTPError(
                400, f"invalid request: {where}: {first.get('msg', 'invalid')}",
                param=where or None, request_id=request_id_of(request),
            ),
            request,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error(GatewayHTTPError(e.status_code, str(e.detail), type_="invalid_request_error",
                                       request_id=request_id_of(request)), request)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "sessions": len(service.sessions)}

    @app.get("/sessions/{session_id}/v1/models")
    async def models(session_id: str, request: Request) -> dict[str, Any]:
        service.session(session_id, _api_key(request), check_key=True)
        return {"object": "list", "data": [{"id": service.model_name, "object": "model",
                                            "created": int(time.time()), "owned_by": "agentloop"}]}

    for dialect in DIALECTS.values():
        _add_dialect_routes(app, service, dialect, max_body_bytes)

    @app.post("/sessions/{session_id}/complete", openapi_extra=_COMPLETE_OPENAPI)
    async def complete(session_id: str, request: Request) -> dict[str, Any]:
        service.session(session_id, _api_key(request), check_key=True)
        body = await read_json(request, max_body_bytes, required=False)
        if body is not None and not isinstance(body, dict):
            raise GatewayHTTPError(
                400, 'the body must be a JSON object like {"reward_info": {...}}'
            )
        reward_info = (body or {}).get("reward_info")
        if reward_info is not None and not isinstance(reward_info, dict):
            raise GatewayHTTPError(400, "reward_info must be a JSON object, e.g. {\"score\": 1.0}",
                                   param="reward_info")
        return service.complete(session_id, reward_info)

    return app


def _add_dialect_routes(
    app: FastAPI, service: GatewayService, dialect: Dialect, max_body_bytes: int
) -> None:
    """``POST /sessions/{id}/v1{path}`` (and ``/v1/v1{path}``, for SDKs that append ``/v1`` to a
    base URL ending in ``/v1``), plus ``{path}/count_tokens`` when the dialect counts."""

    async def serve(session_id: str, request: Request) -> Any:
        service.session(session_id, _api_key(request), check_key=True)
        body = await read_json(request, max_body_bytes)
        result = await service.handle(session_id, dialect, body, request_id=request_id_of(request))
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    for prefix in ("/sessions/{session_id}/v1", "/sessions/{session_id}/v1/v1"):
        alias = prefix.endswith("/v1/v1")
        suffix = "_alias" if alias else ""
        app.add_api_route(
            f"{prefix}{dialect.path}", serve, methods=["POST"], openapi_extra=dialect.openapi,
            include_in_schema=not alias, name=f"{dialect.name}{suffix}",
        )
        counter = _count_route(service, dialect, max_body_bytes)
        if counter is not None:
            app.add_api_route(
                f"{prefix}{dialect.path}/count_tokens", counter, methods=["POST"],
                include_in_schema=not alias, name=f"{dialect.name}_count_tokens{suffix}",
            )


def _count_route(service: GatewayService, dialect: Dialect, max_body_bytes: int) -> Any:
    """The ``count_tokens`` endpoint of ``dialect`` (None when it does not count)."""
    parse_count, render_count = dialect.parse_count, dialect.render_count
    if parse_count is None or render_count is None:
        return None

    async def count(session_id: str, request: Request) -> Any:
        service.session(session_id, _api_key(request), check_key=True)
        body = await read_json(request, max_body_bytes)
        request_ = parse_count(body, service.dialect_state(session_id, dialect.name))
        return JSONResponse(render_count(service.count_tokens(session_id, request_)))

    return count
