"""The Anthropic Messages dialect's reply side: the ``message`` object, its event stream and errors.

:func:`render` gives the non-streamed ``message``; :func:`render_stream` the server-sent events
(``message_start``, ``ping``, ``content_block_start`` / ``_delta`` / ``_stop`` per block,
``message_delta``, ``message_stop``) whose accumulation (the anthropic SDK's
``messages.stream(...).get_final_message()``) equals it, ids aside; :func:`error_body` an error in
Anthropic's shape.  The request side is :mod:`agentloop.gateway.dialects.messages`.
Spec: docs/gateway.md#dialects.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from agentloop.gateway.protocol import GatewayHTTPError
from agentloop.gateway.turn import ReasoningDelta, TextDelta, TurnEvent, TurnRequest, TurnResult

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
    403: "permission_error", 404: "not_found_error", 429: "rate_limit_error",
    503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error",
}
"""HTTP status -> Anthropic error type (other 4xx: invalid_request_error; other 5xx: api_error)."""


def new_message_id() -> str:
    """``msg_…`` id."""
    return f"msg_{uuid.uuid4().hex[:24]}"


def thinking_signature(thinking: str) -> str:
    """The ``signature`` of a thinking block: the SHA-256 of its text (not checked on the way
    back)."""
    return hashlib.sha256(thinking.encode("utf-8")).hexdigest()


def error_body(error: GatewayHTTPError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}, "request_id"?}``; the type follows the
    HTTP status."""
    if error.status in _ERROR_TYPES:
        kind = _ERROR_TYPES[error.status]
    elif error.status < 500:
        kind = "invalid_request_error"
    else:
        kind = "api_error"
    body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": error.message}}
    if error.request_id is not None:
        body["request_id"] = error.request_id
    return body


def stop_reason(result: TurnResult) -> str:
    """``tool_use`` / ``max_tokens`` / ``stop_sequence`` / ``end_turn`` from the turn's finish."""
    if result.finish_reason == "tool_calls":
        return "tool_use"
    if result.finish_reason == "length":
        return "max_tokens"
    if result.stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def usage(result: TurnResult) -> dict[str, int]:
    """The ``usage`` object (no prompt cache is reported)."""
    return {
        "input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens,
        "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
    }


def tool_input(arguments: Any) -> dict[str, Any]:
    """A call's arguments (the JSON string the model wrote) as the ``input`` object.

    The decoder only returns calls whose arguments are a JSON object (anything else stays in
    the content); should one not be, it is logged and sent as ``{"arguments": <the text>}``."""
    value = arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            value = None
    if isinstance(value, dict):
        return value
    logger.warning("a tool call's arguments are not a JSON object: %r", arguments)
    return {"arguments": arguments}


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A thinking block (if reasoning), a text block (if text), one tool_use block per call, in
    that order."""
    blocks: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or ""
    if reasoning:
        blocks.append(
            {"type": "thinking", "thinking": reasoning, "signature": thinking_signature(reasoning)}
        )
    text = message.get("content") or ""
    if text:
        blocks.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        blocks.append(
            {
                "type": "tool_use", "id": call["id"], "name": fn["name"],
                "input": tool_input(fn["arguments"]),
            }
        )
    return blocks


def render(result: TurnResult, request: TurnRequest, state: dict[str, Any]) -> dict[str, Any]:
    """The non-streamed ``message`` object of one served turn."""
    return _message(new_message_id(), request.model, content_blocks(result.message), result)


def _message(
    message_id: str, model: str, blocks: list[dict[str, Any]], result: TurnResult | None
) -> dict[str, Any]:
    reason = None if result is None else stop_reason(result)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": result.stop_sequence
        if result is not None and reason == "stop_sequence"
        else None,
        "usage": {
            "input_tokens": 0, "output_tokens": 0, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }
        if result is None
        else usage(result),
    }


def sse(event: dict[str, Any]) -> str:
    """One server-sent event: ``event: <type>`` and the JSON ``data`` line."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class _Blocks:
    """The content blocks streamed so far (the last one may be open)."""

    def __init__(self) -> None:
        self.kinds: list[str] = []
        self.sent: list[str] = []
        self.open = False

    def delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        """Events for more ``text`` of a ``thinking`` / ``text`` block (opening it if needed)."""
        if not text:
            return []
        events: list[dict[str, Any]] = []
        if not self.open or self.kinds[-1] != kind:
            events += self.close()
            events.append(self.start(_empty(kind)))
        self.sent[-1] += text
        return [*events, _delta(len(self.kinds) - 1, kind, text)]

    def start(self, block: dict[str, Any]) -> dict[str, Any]:
        self.kinds.append(block["type"])
        self.sent.append("")
        self.open = True
        return {"type": "content_block_start", "index": len(self.kinds) - 1, "content_block": block}

    def close(self) -> list[dict[str, Any]]:
        if not self.open:
            return []
        self.open = False
        index = len(self.kinds) - 1
        events: list[dict[str, Any]] = []
        if self.kinds[index] == "thinking":
            signature = thinking_signature(self.sent[index])
            events.append(
                {
                    "type": "content_block_delta", "index": index,
                    "delta": {"type": "signature_delta", "signature": signature},
                }
            )
        return [*events, {"type": "content_block_stop", "index": index}]

    def finish(self, blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Events that complete the stream so it accumulates to ``blocks`` (the final content)."""
        events: list[dict[str, Any]] = []
        for i, block in enumerate(blocks):
            if i < len(self.kinds):
                if self.kinds[i] != block["type"]:
                    logger.warning(
                        "streamed block %d was %s, the final one is %s", i, self.kinds[i],
                        block["type"],
                    )
                events += self._tail(i, block)
                continue
            events += self.close()
            if block["type"] == "tool_use":
                events.append(self.start({**block, "input": {}}))
                events.append(
                    {
                        "type": "content_block_delta",
                        "index": i,
                        "delta": {
                            "type": "input_json_delta",
                            "partial_json": json.dumps(block["input"], ensure_ascii=False),
                        },
                    }
                )
            else:
                events.append(self.start(_empty(block["type"])))
                events += self._tail(i, block)
        return events + self.close()

    def _tail(self, i: int, block: dict[str, Any]) -> list[dict[str, Any]]:
        """What of an already streamed block's final text is not sent yet."""
        final = block.get("thinking", block.get("text", ""))
        if final == self.sent[i]:
            return []
        if not final.startswith(self.sent[i]) or (i < len(self.kinds) - 1 or not self.open):
            logger.warning("streamed %s block %d does not lead to the final text", self.kinds[i], i)
            return []
        tail = final[len(self.sent[i]) :]
        self.sent[i] = final
        return [_delta(i, block["type"], tail)]


def _empty(kind: str) -> dict[str, Any]:
    if kind == "thinking":
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {"type": "text", "text": ""}


def _delta(index: int, kind: str, text: str) -> dict[str, Any]:
    if kind == "thinking":
        delta = {"type": "thinking_delta", "thinking": text}
    else:
        delta = {"type": "text_delta", "text": text}
    return {"type": "content_block_delta", "index": index, "delta": delta}


async def render_stream(
    events: AsyncIterator[TurnEvent], request: TurnRequest, state: dict[str, Any]
) -> AsyncIterator[str]:
    """Server-sent events of one served turn; an error raised by ``events`` becomes an ``error``
    event.

    ``message_start`` carries ``usage.input_tokens`` 0 (the prompt is counted once the engine is
    done); ``message_delta`` carries the final ``usage`` (input and output tokens), which the SDK's
    accumulator takes over."""
    message_id = new_message_id()
    yield sse({"type": "message_start", "message": _message(message_id, request.model, [], None)})
    yield sse({"type": "ping"})
    blocks = _Blocks()
    result: TurnResult | None = None
    try:
        async for event in events:
            if isinstance(event, TurnResult):
                result = event  # the last event: the iterator ends (and cleans up) after it
            elif isinstance(event, (ReasoningDelta, TextDelta)):
                kind = "thinking" if isinstance(event, ReasoningDelta) else "text"
                for out in blocks.delta(kind, event.text):
                    yield sse(out)
    except GatewayHTTPError as e:
        yield sse(error_body(e))
        return
    if result is None:
        logger.error("a streamed Messages turn ended without its result")
        yield sse(
            error_body(
                GatewayHTTPError(
                    500, "internal gateway error: the turn ended without a result",
                    type_="server_error",
                )
            )
        )
        return
    for out in blocks.finish(content_blocks(result.message)):
        yield sse(out)
    final = _message(message_id, request.model, [], result)
    yield sse(
        {
            "type": "message_delta",
            "delta": {"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]},
            "usage": final["usage"],
        }
    )
    yield sse({"type": "message_stop"})
