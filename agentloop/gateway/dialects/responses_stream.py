"""The OpenAI Responses API dialect: the reply side (a ``response`` object, its event stream,
errors) and the per-session store of responses behind ``previous_response_id``.

Output items, in this order: a ``reasoning`` item (``reasoning_text`` content) when the turn has
reasoning, a ``message`` item (one ``output_text`` part) when it has text or no tool calls, and one
``function_call`` item per tool call.  Item ids derive from the response id (``rs_`` / ``msg_`` /
``fc_<n>_``), so a streamed response ends with exactly the body the non-streamed one returns.
Spec: docs/gateway.md#dialects.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from agentloop.gateway.protocol import GatewayHTTPError, normalize_message
from agentloop.gateway.turn import ReasoningDelta, TextDelta, TurnEvent, TurnRequest, TurnResult

_STORE_KEY = "responses"
"""The dialect-state key of ``{response id: {"previous": id | None, "messages": [...]}}``."""


# ---- stored responses (previous_response_id) ---------------------------------------------------
def recall(state: dict[str, Any], response_id: str | None) -> list[dict[str, Any]]:
    """The conversation of a stored response (its input items and output, not its instructions).

    Raises:
        GatewayHTTPError: 400 ``previous_response_not_found`` for an id this session did not store.
    """
    if response_id is None:
        return []
    stored = state.get(_STORE_KEY, {})
    if response_id not in stored:
        raise GatewayHTTPError(400, f"Previous response with id {response_id!r} not found (this "
                                    "session stored no such response; was it sent with store: "
                                    "false?)", param="previous_response_id",
                               code="previous_response_not_found")
    chain: list[list[dict[str, Any]]] = []
    rid: str | None = response_id
    while rid is not None:
        entry = stored[rid]
        chain.append(entry["messages"])
        rid = entry["previous"]
    return [dict(msg) for part in reversed(chain) for msg in part]


def remember(state: dict[str, Any], request: TurnRequest, message: dict[str, Any]) -> None:
    """Store a served response (unless ``store: false``): its new input messages and its output,
    linked to its ``previous_response_id`` (so memory grows with the turns, not their square)."""
    echo = request.extra["echo"]
    if not echo["store"]:
        return
    assistant = normalize_message(message, 0)
    if message.get("reasoning_content"):
        assistant["reasoning_content"] = message["reasoning_content"]
    state.setdefault(_STORE_KEY, {})[request.extra["response_id"]] = {
        "previous": echo["previous_response_id"],
        "messages": [*request.extra["new_messages"], assistant],
    }


# ---- the response object -----------------------------------------------------------------------
def _ids(request: TurnRequest) -> tuple[str, str, str]:
    """(reasoning item id, message item id, function-call item id prefix) of a response."""
    suffix = request.extra["response_id"].removeprefix("resp_")
    return f"rs_{suffix}", f"msg_{suffix}", f"fc_{suffix}"


def _reasoning_item(request: TurnRequest, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"id": _ids(request)[0], "type": "reasoning", "summary": [], "content": content,
            "status": status}


def _message_item(request: TurnRequest, text: str, status: str) -> dict[str, Any]:
    content = [] if status == "in_progress" else [_text_part(text)]
    return {"id": _ids(request)[1], "type": "message", "role": "assistant", "status": status,
            "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_items(request: TurnRequest, message: dict[str, Any], status: str) -> list[dict[str, Any]]:
    prefix = _ids(request)[2]
    done = status == "completed"
    return [{"id": f"{prefix}_{n}", "type": "function_call", "call_id": call["id"],
             "name": call["function"]["name"], "status": status,
             "arguments": _arguments(call["function"]["arguments"]) if done else ""}
            for n, call in enumerate(message.get("tool_calls") or [])]


def _arguments(arguments: Any) -> str:
    """Arguments as the JSON string the model wrote (a parsed value is dumped back)."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _wants_message(message: dict[str, Any]) -> bool:
    return bool(message.get("content")) or not message.get("tool_calls")


def _output(result: TurnResult, request: TurnRequest,
            order: tuple[str, ...] = ("reasoning", "message")) -> list[dict[str, Any]]:
    """The output items of a finished turn; ``order`` is the order reasoning and message were
    streamed in (function calls always come last)."""
    msg = result.message
    status = "incomplete" if result.finish_reason == "length" else "completed"
    items: dict[str, dict[str, Any]] = {}
    if msg.get("reasoning_content"):
        items["reasoning"] = _reasoning_item(request, msg["reasoning_content"], "completed")
    if _wants_message(msg):
        items["message"] = _message_item(request, msg.get("content") or "", status)
    return [*(items[k] for k in order if k in items), *_call_items(request, msg, "completed")]


def _shell(request: TurnRequest, status: str) -> dict[str, Any]:
    """The response object without output and usage (status ``in_progress`` while streaming)."""
    return {"id": request.extra["response_id"], "object": "response",
            "created_at": request.extra["created_at"], "model": request.model, "status": status,
            "error": None, "incomplete_details": None, "output": [], "usage": None,
            **request.extra["echo"]}


def _usage(result: TurnResult) -> dict[str, Any]:
    return {"input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def response_body(result: TurnResult, request: TurnRequest,
                  order: tuple[str, ...] = ("reasoning", "message")) -> dict[str, Any]:
    """The finished ``response`` object: status ``completed``, or ``incomplete`` with
    ``incomplete_details.reason = max_output_tokens`` when the turn ran out of tokens."""
    length = result.finish_reason == "length"
    body = _shell(request, "incomplete" if length else "completed")
    body["output"] = _output(result, request, order)
    body["usage"] = _usage(result)
    if length:
        body["incomplete_details"] = {"reason": "max_output_tokens"}
    return body


def render(result: TurnResult, request: TurnRequest, state: dict[str, Any]) -> dict[str, Any]:
    """The non-streamed reply body; stores the response for ``previous_response_id``."""
    remember(state, request, result.message)
    return response_body(result, request)


def error_body(error: GatewayHTTPError) -> dict[str, Any]:
    """OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``."""
    return error.body()


# ---- streaming ---------------------------------------------------------------------------------
class _Events:
    """Numbers and formats the events of one streamed response and tracks its open items."""

    def __init__(self, request: TurnRequest) -> None:
        self.request = request
        self.seq = 0
        self.order: list[str] = []
        self.open: str | None = None  # "reasoning" | "message" while its deltas stream
        self.texts = {"reasoning": "", "message": ""}

    def sse(self, type_: str, **fields: Any) -> str:
        data = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {type_}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _where(self, kind: str) -> dict[str, Any]:
        item_id = _ids(self.request)[0] if kind == "reasoning" else _ids(self.request)[1]
        return {"item_id": item_id, "output_index": self.order.index(kind), "content_index": 0}

    def _start(self, kind: str) -> Iterator[str]:
        self.order.append(kind)
        self.open = kind
        if kind == "reasoning":
            item = _reasoning_item(self.request, "", "in_progress")
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = _message_item(self.request, "", "in_progress")
            part = _text_part("")
        yield self.sse("response.output_item.added", output_index=len(self.order) - 1, item=item)
        yield self.sse("response.content_part.added", part=part, **self._where(kind))

    def delta(self, kind: str, text: str) -> Iterator[str]:
        """More reasoning or answer text (an item is opened on its first delta)."""
        if self.open != kind:
            if kind in self.order or (kind == "reasoning" and "message" in self.order):
                return  # reasoning after the answer began: its item follows the message at the end
            yield from self.close(None)
            yield from self._start(kind)
        self.texts[kind] += text
        if kind == "reasoning":
            yield self.sse("response.reasoning_text.delta", delta=text, **self._where(kind))
        else:
            yield self.sse("response.output_text.delta", delta=text, logprobs=[],
                           **self._where(kind))

    def close(self, result: TurnResult | None) -> Iterator[str]:
        """Close the open item (with the result's text when the result is known)."""
        kind, self.open = self.open, None
        if kind is None:
            return
        where = self._where(kind)
        text = self.texts[kind]
        if result is not None:
            text = _final_text(result, kind)
            if text != self.texts[kind] and text.startswith(self.texts[kind]):
                yield from self._tail(kind, text[len(self.texts[kind]):])
        if kind == "reasoning":
            item = _reasoning_item(self.request, text, "completed")
            yield self.sse("response.reasoning_text.done", text=text, **where)
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
        else:
            length = result is not None and result.finish_reason == "length"
            item = _message_item(self.request, text, "incomplete" if length else "completed")
            yield self.sse("response.output_text.done", text=text, logprobs=[], **where)
            part = _text_part(text)
        yield self.sse("response.content_part.done", part=part, **where)
        yield self.sse("response.output_item.done", output_index=where["output_index"], item=item)

    def _tail(self, kind: str, text: str) -> Iterator[str]:
        self.texts[kind] += text
        name = "reasoning_text" if kind == "reasoning" else "output_text"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        yield self.sse(f"response.{name}.delta", delta=text, **extra, **self._where(kind))

    def finish(self, result: TurnResult) -> Iterator[str]:
        """Close what is open, stream what the deltas did not carry, then the final response."""
        wanted = [k for k in ("reasoning", "message") if _final_text(result, k)
                  or (k == "message" and _wants_message(result.message))]
        for kind in wanted:
            if kind not in self.order:
                yield from self.close(result)
                yield from self._start(kind)
                text = _final_text(result, kind)
                if text:
                    yield from self._tail(kind, text)
        yield from self.close(result)
        start = len(self.order)
        added = _call_items(self.request, result.message, "in_progress")
        done = _call_items(self.request, result.message, "completed")
        for n, (item, final) in enumerate(zip(added, done, strict=True)):
            where = {"item_id": item["id"], "output_index": start + n}
            args = final["arguments"]
            yield self.sse("response.output_item.added", output_index=start + n, item=item)
            yield self.sse("response.function_call_arguments.delta", delta=args, **where)
            yield self.sse("response.function_call_arguments.done", arguments=args, **where)
            yield self.sse("response.output_item.done", output_index=start + n, item=final)
        body = response_body(result, self.request, tuple(self.order))
        yield self.sse(f"response.{body['status']}", response=body)

    def failed(self, error: GatewayHTTPError) -> Iterator[str]:
        """An ``error`` event (the gateway's code and message), then ``response.failed``."""
        yield self.sse("error", code=error.code or error.type, message=error.message,
                       param=error.param)
        body = _shell(self.request, "failed")
        code = "server_error" if error.status >= 500 else "invalid_prompt"
        body["error"] = {"code": code, "message": error.message}
        yield self.sse("response.failed", response=body)


def _final_text(result: TurnResult, kind: str) -> str:
    key = "reasoning_content" if kind == "reasoning" else "content"
    return result.message.get(key) or ""


async def render_stream(events: AsyncIterator[TurnEvent], request: TurnRequest,
                        state: dict[str, Any]) -> AsyncIterator[str]:
    """Server-sent events: ``response.created``, ``response.in_progress``, the items' events, then
    ``response.completed`` (or ``response.incomplete``) carrying exactly the non-streamed body; a
    :class:`GatewayHTTPError` from ``events`` ends the stream with ``error`` and
    ``response.failed``.  The response is stored once it completed."""
    out = _Events(request)
    yield out.sse("response.created", response=_shell(request, "in_progress"))
    yield out.sse("response.in_progress", response=_shell(request, "in_progress"))
    result: TurnResult | None = None
    try:
        async for event in events:
            if isinstance(event, ReasoningDelta):
                for line in out.delta("reasoning", event.text):
                    yield line
            elif isinstance(event, TextDelta):
                for line in out.delta("message", event.text):
                    yield line
            elif isinstance(event, TurnResult):
                result = event
    except GatewayHTTPError as e:
        for line in out.failed(e):
            yield line
        return
    if result is None:
        for line in out.failed(GatewayHTTPError(500, "the turn ended without a result",
                                                type_="server_error")):
            yield line
        return
    remember(state, request, result.message)
    for line in out.finish(result):
        yield line
