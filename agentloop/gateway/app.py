"""The gateway's HTTP surface (FastAPI) over a :class:`~agentloop.gateway.service.GatewayService`.

Routes (every session route needs ``Authorization: Bearer <session api_key>``):

* ``POST /sessions/{id}/v1/chat/completions`` — OpenAI chat completions, streaming or not.
* ``GET /sessions/{id}/v1/models`` — the served model.
* ``POST /sessions/{id}/complete`` — body ``{"reward_info": {...}}`` (optional): the agent is done.
* ``GET /health``.

Errors are OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``): 400 malformed JSON or
a refused request, 401 missing/wrong key, 404 unknown session, 409 session completed or aborted, 413
body over ``max_body_bytes``, 502 engine failure (nothing is committed to the session).
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentloop.gateway.protocol import ChatCompletionBody, GatewayHTTPError
from agentloop.gateway.service import GatewayService

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


def _error(e: GatewayHTTPError) -> JSONResponse:
    return JSONResponse(status_code=e.status, content=e.body())


async def read_json(request: Request, max_body_bytes: int, *, required: bool = True) -> Any:
    """The decoded JSON body; 413 above the limit (checked while reading), 400 when not JSON."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_body_bytes:
        raise GatewayHTTPError(413, f"request body of {declared} bytes is over the limit of {max_body_bytes}",
                               type_="request_too_large")
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
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GatewayHTTPError(400, f"the request body is not valid JSON: {e}") from None


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


_MESSAGE_SCHEMA = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {"type": "object"}}]},
        "name": {"type": "string"},
        "tool_call_id": {"type": "string"},
        "tool_calls": {"type": "array", "items": {"type": "object"}},
    },
}


def _chat_openapi() -> dict[str, Any]:
    schema = ChatCompletionBody.model_json_schema()
    schema["properties"]["messages"]["items"] = _MESSAGE_SCHEMA
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


_COMPLETE_OPENAPI = {"requestBody": {"required": False, "content": {"application/json": {"schema": {
    "type": "object", "properties": {"reward_info": {"type": "object"}}}}}}}


def build_app(service: GatewayService, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI application of one gateway."""
    app = FastAPI(title="agentloop gateway", version="1")

    @app.exception_handler(GatewayHTTPError)
    async def _gateway_error(_: Request, e: GatewayHTTPError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return _error(GatewayHTTPError(400, f"invalid request: {e.errors()[:1]}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error(GatewayHTTPError(e.status_code, str(e.detail), type_="invalid_request_error"))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "sessions": len(service.sessions)}

    @app.get("/sessions/{session_id}/v1/models")
    async def models(session_id: str, request: Request) -> dict[str, Any]:
        service.session(session_id, _bearer(request), check_key=True)
        return {"object": "list", "data": [{"id": service.model_name, "object": "model",
                                            "created": int(time.time()), "owned_by": "agentloop"}]}

    @app.post("/sessions/{session_id}/v1/chat/completions", openapi_extra=_chat_openapi())
    async def chat_completions(session_id: str, request: Request) -> Any:
        service.session(session_id, _bearer(request), check_key=True)
        body = await read_json(request, max_body_bytes)
        result = await service.chat(session_id, body)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/sessions/{session_id}/complete", openapi_extra=_COMPLETE_OPENAPI)
    async def complete(session_id: str, request: Request) -> dict[str, Any]:
        service.session(session_id, _bearer(request), check_key=True)
        body = await read_json(request, max_body_bytes, required=False)
        if body is not None and not isinstance(body, dict):
            raise GatewayHTTPError(400, "the body must be a JSON object like {\"reward_info\": {...}}")
        reward_info = (body or {}).get("reward_info")
        if reward_info is not None and not isinstance(reward_info, dict):
            raise GatewayHTTPError(400, "reward_info must be a JSON object, e.g. {\"score\": 1.0}",
                                   param="reward_info")
        return service.complete(session_id, reward_info)

    return app
