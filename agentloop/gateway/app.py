"""The gateway's HTTP surface (FastAPI) over a :class:`~agentloop.gateway.service.GatewayService`.

Routes: one ``POST /sessions/{id}/v1{path}`` per dialect
(:data:`agentloop.gateway.dialects.DIALECTS`: ``/chat/completions``, …; streaming or not; also under
``/sessions/{id}/v1/v1``), ``GET /sessions/{id}/v1/models``, ``POST /sessions/{id}/complete`` and
``GET /health``; every session route needs the session's api_key as ``Authorization: Bearer <key>``
or ``x-api-key: <key>``.  Errors carry a request id (also in every response's ``x-request-id``
header), in the shape of the dialect whose route was hit (OpenAI's elsewhere): 4xx for the client's
faults, 5xx only for the gateway's own (details only in the server log line ``request <id>: ...``).
Spec (every status code): docs/gateway.md#http-api."""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentloop.config.build import read_value
from agentloop.gateway.dialects import DIALECTS, Dialect, dialect_for_path
from agentloop.gateway.protocol import GatewayHTTPError
from agentloop.gateway.service import GatewayService

DEFAULT_MAX_BODY_BYTES: int = read_value(None, "actor_rollout_ref.rollout.gateway.max_body_bytes")
"""The YAML's ``gateway.max_body_bytes`` (8 MiB): :func:`build_app`'s default."""
MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays / objects a request body may have."""

logger = logging.getLogger(__name__)


def _error(e: GatewayHTTPError, request: Request | None = None) -> JSONResponse:
    """``e`` as a response, in the error shape of the dialect whose route ``request`` hit (else
    OpenAI's)."""
    dialect = None if request is None else dialect_for_path(request.url.path)
    body = e.body() if dialect is None else dialect.error_body(e)
    return JSONResponse(status_code=e.status, content=body)


async def read_json(request: Request, max_body_bytes: int, *, required: bool = True) -> Any:
    """The decoded JSON body; 413 above the limit (checked while reading), 400 when not JSON."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_body_bytes:
        raise GatewayHTTPError(
            413, f"request body of {declared} bytes is over the limit of {max_body_bytes}",
            type_="request_too_large",
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise GatewayHTTPError(413, f"request body is over the limit of {max_body_bytes} bytes",
                                   type_="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        if required:
            raise GatewayHTTPError(400, "the request body is empty; send a JSON object")
        return None
    return decode_json(raw)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (use a finite number or null)")


def decode_json(raw: bytes) -> Any:
    """Parse a request body; 400 for invalid JSON, non-finite numbers, huge integers or too deep
    nesting."""
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        value = None
        deep = True
    # JSONDecodeError, NaN, integers over Python's digit limit
    except (ValueError, UnicodeDecodeError) as e:
        raise GatewayHTTPError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None
    else:
        deep = json_depth_over(value, MAX_JSON_DEPTH)
    if deep:
        raise GatewayHTTPError(
            400,
            f"the request body nests arrays/objects more than "
            f"{MAX_JSON_DEPTH} levels deep; "
            "flatten it",
        )
    return value


def json_depth_over(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists / dicts more than ``limit`` levels deep (iterative, no
    recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def _api_key(request: Request) -> str | None:
    """The session key: ``Authorization: Bearer <key>`` (OpenAI SDKs) or ``x-api-key: <key>``
    (Anthropic's)."""
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key", "").strip() or None


_COMPLETE_OPENAPI = {"requestBody": {"required": False, "content": {"application/json": {"schema": {
    "type": "object", "properties": {"reward_info": {"type": "object"}}}}}}}


def request_id_of(request: Request) -> str:
    """The id :class:`RequestIdMiddleware` gave this request."""
    return str(request.scope.get("state", {}).get("request_id") or new_request_id())


def new_request_id() -> str:
    """``req_…`` id."""
    return f"req_{uuid.uuid4().hex[:24]}"


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
            error = GatewayHTTPError(
                500,
                f"internal gateway error; the server log has the details under request id {rid}",
                type_="server_error", request_id=rid,
            )
            dialect = dialect_for_path(str(scope.get("path", "")))
            body = error.body() if dialect is None else dialect.error_body(error)
            await JSONResponse(status_code=500, content=body, headers={"x-request-id": rid})(
                scope, receive, send
            )


def build_app(service: GatewayService, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI application of one gateway."""
    app = FastAPI(title="agentloop gateway", version="1")
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
