"""The OpenAI chat-completions dialect: request checking and response shapes.

:func:`parse_chat_request` turns a JSON body into a canonical
:class:`~agentloop.gateway.turn.TurnRequest` (alias :data:`ChatRequest`) or raises
:class:`GatewayHTTPError` (400 naming the parameter; rendered as an OpenAI-shaped error body by the
app): messages are checked and text parts joined, sampling keys are whitelisted and range-checked
before any engine sees them, and unsupported options (``n != 1``, a ``response_format`` other than
text / JSON, a ``tool_choice`` other than auto / none / required / a named function, image parts
other than base64 data URLs) are refused.  Spec (accepted values, kept and ignored keys):
docs/gateway.md#errors-and-request-ids.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentloop.gateway.images import ImagePartError, image_url_part
from agentloop.gateway.turn import ToolChoice, TurnRequest

_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 16
"""Most stop strings one request may send."""
MAX_STOP_CHARS = 1000
"""Longest stop string."""
_INT64 = 2**63


class GatewayHTTPError(Exception):
    """An error with its HTTP status and an OpenAI-shaped body."""

    def __init__(
        self, status: int, message: str, *, type_: str = "invalid_request_error",
        param: str | None = None, code: str | None = None, request_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.request_id = request_id

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}`` as the OpenAI API returns, plus the
        ``request_id`` (also sent as the ``x-request-id`` header) when one is known."""
        error: dict[str, Any] = {
            "message": self.message, "type": self.type, "param": self.param, "code": self.code,
        }
        if self.request_id is not None:
            error["request_id"] = self.request_id
        return {"error": error}


class ChatCompletionBody(BaseModel):
    """The request body (types only; the rules are checked in :func:`parse_chat_request`)."""

    model_config = ConfigDict(extra="allow")

    model: str = "agentloop"
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-_INT64, lt=_INT64)
    n: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    response_format: dict[str, Any] | None = None


ChatRequest = TurnRequest
"""The checked chat-completions request: the canonical
:class:`~agentloop.gateway.turn.TurnRequest`."""


def _bad(message: str, param: str | None = None) -> GatewayHTTPError:
    return GatewayHTTPError(400, message, param=param)


def parse_chat_request(body: Any) -> TurnRequest:
    """Check a decoded JSON body; raises :class:`GatewayHTTPError` (400) on anything we refuse."""
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        req = ChatCompletionBody.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        # union members add type tags ("str", "list[str]"): keep the key and indices
        loc = first["loc"]
        where = (
            ".".join([str(loc[0]), *(str(p) for p in loc[1:] if isinstance(p, int))])
            if loc
            else "body"
        )
        raise _bad(f"invalid request: {where}: {first['msg']}", param=where) from None
    _check_stop(req.stop)
    if req.n not in (None, 1):
        raise _bad(
            f"n={req.n} is not supported: the gateway returns one choice per "
            f"request; send n requests",
            param="n",
        )
    kind = (req.response_format or {}).get("type", "text")
    if kind not in ("text", "json_object", "json_schema"):
        raise _bad(
            f"response_format type {kind!r} is not supported; use 'text', "
            f"'json_object' or 'json_schema'",
            param="response_format",
        )
    tool_choice = _tool_choice(req.tool_choice)
    messages = [normalize_message(m, i) for i, m in enumerate(req.messages)]
    tools = [_check_tool(t, i) for i, t in enumerate(req.tools)] if req.tools else None
    return TurnRequest(
        model=req.model, messages=messages, tools=tools, sampling=_sampling(req), stream=req.stream,
        include_usage=bool((req.stream_options or {}).get("include_usage")),
        want_logprobs=bool(req.logprobs), tool_choice=tool_choice,
        response_format=None if kind == "text" else req.response_format,
    )


def _tool_choice(raw: str | dict[str, Any] | None) -> ToolChoice:
    """Chat's ``tool_choice`` in canonical form (a named function becomes
    ``{"type": "function", "name"}``); whether it can be honoured (tools, the served format) is
    checked when it is served (gateway/constraints.py)."""
    if raw is None:
        return "auto"
    if raw in ("auto", "none", "required"):
        return raw  # type: ignore[return-value]
    fn = raw.get("function") if isinstance(raw, dict) and raw.get("type") == "function" else None
    if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]:
        return {"type": "function", "name": fn["name"]}
    raise _bad(f"tool_choice={raw!r} is not supported; use 'auto', 'none', 'required' or "
               "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")


def _check_stop(stop: str | list[str] | None) -> None:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP:
        raise _bad(f"stop has {len(stops)} strings; send at most {MAX_STOP}", param="stop")
    for s in stops:
        if not s:
            raise _bad(
                "stop contains an empty string; remove it (an empty stop string "
                "would end every "
                "generation at once)",
                param="stop",
            )
        if len(s) > MAX_STOP_CHARS:
            raise _bad(
                f"a stop string has {len(s)} characters; the limit is {MAX_STOP_CHARS}",
                param="stop",
            )


def _sampling(req: ChatCompletionBody) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("temperature", "top_p", "top_k", "seed"):
        value = getattr(req, key)
        if value is not None:
            out[key] = value
    max_tokens = req.max_completion_tokens or req.max_tokens
    if max_tokens is not None:
        out["max_tokens"] = int(max_tokens)
    if req.stop:
        out["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    return out


def _check_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    fn = tool.get("function")
    if (
        tool.get("type", "function") != "function"
        or not isinstance(fn, dict)
        or not isinstance(fn.get("name"), str)
    ):
        raise _bad(
            f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
            f"'parameters': ...}}}}",
            param=f"tools.{i}",
        )
    return {"type": "function", "function": fn}


def normalize_message(msg: dict[str, Any], i: int) -> dict[str, Any]:
    """One message in the form chat templates expect (docs/gateway.md#errors-and-request-ids)."""
    role = msg.get("role")
    if role not in _ROLES:
        raise _bad(
            f"messages[{i}].role must be one of {list(_ROLES)}, got {role!r}",
            param=f"messages.{i}.role",
        )
    out: dict[str, Any] = {"role": role, "content": _content(msg.get("content"), i)}
    if msg.get("name") is not None:
        if not isinstance(msg["name"], str):
            raise _bad(f"messages[{i}].name must be a string", param=f"messages.{i}.name")
        out["name"] = msg["name"]
    if msg.get("tool_call_id") is not None:
        out["tool_call_id"] = str(msg["tool_call_id"])
    calls = msg.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise _bad(f"messages[{i}].tool_calls must be a list on an assistant message",
                       param=f"messages.{i}.tool_calls")
        out["tool_calls"] = [_tool_call(c, i, j) for j, c in enumerate(calls)]
    reasoning = msg.get("reasoning_content")
    # an assistant turn's reasoning, echoed back (docs/gateway.md#reasoning)
    if reasoning is not None:
        if role != "assistant" or not isinstance(reasoning, str):
            raise _bad(f"messages[{i}].reasoning_content must be a string on an assistant message",
                       param=f"messages.{i}.reasoning_content")
        out["reasoning_content"] = reasoning
    return out


def _content(content: Any, i: int) -> str | list[dict[str, Any]]:
    """The text (parts joined), or the parts in order when there is an image
    (docs/gateway.md#images)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise _bad(
            f"messages[{i}].content must be a string, null or a list of parts",
            param=f"messages.{i}.content",
        )
    texts = []
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            try:
                parts.append(image_url_part(part, f"messages.{i}.content.{j}"))
            except ImagePartError as e:
                raise _bad(str(e), param=e.param) from None
        else:
            raise _bad(
                f"messages[{i}].content parts must be {{'type': 'text', 'text': ...}} "
                f"or {{'type': "
                f"'image_url', 'image_url': {{'url': "
                f"'data:image/...;base64,...'}}}}, got {part!r}",
                param=f"messages.{i}.content",
            )
    return parts if len(parts) > len(texts) else "".join(texts)


def _tool_call(call: Any, i: int, j: int) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _bad(
            f"messages[{i}].tool_calls[{j}] needs function.name",
            param=f"messages.{i}.tool_calls.{j}",
        )
    args: Any = fn.get("arguments", "{}")
    if isinstance(args, str):
        with contextlib.suppress(json.JSONDecodeError):  # else kept as the string the model wrote
            args = json.loads(args) if args.strip() else {}
    return {
        "id": str(call.get("id") or ""), "type": "function",
        "function": {"name": fn["name"], "arguments": args},
    }


def new_completion_id() -> str:
    """``chatcmpl-…`` id."""
    return f"chatcmpl-{uuid.uuid4().hex}"


def openai_tool_calls(calls: list[Any]) -> list[dict[str, Any]]:
    """Parsed :class:`~agentloop.parsers.base.FunctionCall` objects as OpenAI ``tool_calls``."""
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


def completion_body(
    *, completion_id: str, model: str, message: dict[str, Any], finish_reason: str,
    prompt_tokens: int, completion_tokens: int, logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` object."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}
        ],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chunk_body(
    *, completion_id: str, model: str, created: int, delta: dict[str, Any] | None,
    finish_reason: str | None = None, usage_: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``; ``delta=None`` gives the usage-only chunk (no choices)."""
    body: dict[str, Any] = {
        "id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [],
    }
    if delta is not None:
        body["choices"] = [
            {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        ]
    if usage_ is not None:
        body["usage"] = usage_
    return body


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The ``usage`` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
