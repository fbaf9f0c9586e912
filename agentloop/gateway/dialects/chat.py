"""The OpenAI chat-completions dialect (``POST /sessions/{id}/v1/chat/completions``).

Parse is :func:`~agentloop.gateway.protocol.parse_chat_request` (chat messages are already the
canonical form); the reply is a ``chat.completion`` object, or ``chat.completion.chunk`` server-sent
events ending with ``data: [DONE]``; errors are OpenAI-shaped
(``{"error": {"message", "type", "param", "code"}}``). Spec: docs/gateway.md#dialects.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from agentloop.gateway.dialects.base import Dialect
from agentloop.gateway.protocol import (
    ChatCompletionBody,
    GatewayHTTPError,
    chunk_body,
    completion_body,
    new_completion_id,
    parse_chat_request,
    usage,
)
from agentloop.gateway.turn import ReasoningDelta, TextDelta, TurnEvent, TurnRequest, TurnResult

_MESSAGE_SCHEMA = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {
            "anyOf": [
                {"type": "string"}, {"type": "null"},
                {"type": "array", "items": {"type": "object"}},
            ]
        },
        "name": {"type": "string"},
        "tool_call_id": {"type": "string"},
        "tool_calls": {"type": "array", "items": {"type": "object"}},
    },
}


def _openapi() -> dict[str, Any]:
    schema = ChatCompletionBody.model_json_schema()
    schema["properties"]["messages"]["items"] = _MESSAGE_SCHEMA
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def parse(body: Any, state: dict[str, Any]) -> TurnRequest:
    """A chat-completions body as a :class:`TurnRequest`; raises :class:`GatewayHTTPError` (400)."""
    return parse_chat_request(body)


def render(result: TurnResult, request: TurnRequest, state: dict[str, Any]) -> dict[str, Any]:
    """The ``chat.completion`` object of ``result``."""
    return completion_body(
        completion_id=new_completion_id(), model=request.model, message=result.message,
        finish_reason=result.finish_reason, prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens, logprobs=result.logprobs,
    )


async def render_stream(
    events: AsyncIterator[TurnEvent], request: TurnRequest, state: dict[str, Any]
) -> AsyncIterator[str]:
    """``chat.completion.chunk`` events: the role chunk, content (and ``reasoning_content``) deltas,
    the tool calls and finish reason, the usage chunk when ``stream_options.include_usage``,
    ``[DONE]``.  An error from ``events`` is sent as one OpenAI error event (no ``[DONE]``)."""
    model, cid, created = request.model, new_completion_id(), int(time.time())
    yield _sse(chunk_body(completion_id=cid, model=model, created=created,
                          delta={"role": "assistant", "content": ""}))
    try:
        async for event in events:
            if isinstance(event, TextDelta):
                yield _sse(chunk_body(completion_id=cid, model=model, created=created,
                                      delta={"content": event.text}))
            elif isinstance(event, ReasoningDelta):
                yield _sse(chunk_body(completion_id=cid, model=model, created=created,
                                      delta={"reasoning_content": event.text}))
            else:
                for chunk in _final_chunks(event, cid, model, created):
                    yield _sse(chunk)
                if request.include_usage:
                    yield _sse(
                        chunk_body(
                            completion_id=cid, model=model, created=created, delta=None,
                            usage_=usage(event.prompt_tokens, event.completion_tokens),
                        )
                    )
    except GatewayHTTPError as e:
        yield _sse(error_body(e))
        return
    yield "data: [DONE]\n\n"


def _final_chunks(result: TurnResult, cid: str, model: str, created: int) -> list[dict[str, Any]]:
    chunks: list[dict[str, Any]] = []
    calls = result.message.get("tool_calls") or []
    if calls:
        deltas = [{"index": i, **call} for i, call in enumerate(calls)]
        chunks.append(
            chunk_body(
                completion_id=cid, model=model, created=created, delta={"tool_calls": deltas}
            )
        )
    chunks.append(chunk_body(completion_id=cid, model=model, created=created, delta={},
                             finish_reason=result.finish_reason))
    return chunks


def error_body(error: GatewayHTTPError) -> dict[str, Any]:
    """The OpenAI error shape (:meth:`GatewayHTTPError.body`)."""
    return error.body()


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


CHAT = Dialect(
    name="chat", path="/chat/completions", parse=parse, render=render, render_stream=render_stream,
    error_body=error_body, openapi=_openapi(),
)
"""The chat-completions dialect."""
