"""The Anthropic Messages dialect: ``POST /sessions/{id}/v1/messages`` and ``.../count_tokens``.

:func:`parse` checks a Messages request body and translates it into the gateway's canonical
:class:`~agentloop.gateway.turn.TurnRequest` (chat-shaped messages and function tools); anything
refused is a :class:`~agentloop.gateway.protocol.GatewayHTTPError` 400 whose ``param`` names the
offending key (``messages.2.content.0.tool_use_id``), rendered in Anthropic's error shape by
:func:`~agentloop.gateway.dialects.messages_stream.error_body`.  Messages and content blocks are
mapped by :mod:`~agentloop.gateway.dialects.messages_blocks`; the reply side (the ``message``
object, its event stream, errors) is :mod:`~agentloop.gateway.dialects.messages_stream`.
Spec (what maps to what, what is refused and why): docs/gateway.md#dialects.
"""

from __future__ import annotations

import re
from typing import Any

from agentloop.gateway.dialects.base import Dialect
from agentloop.gateway.dialects.messages_blocks import (
    MAX_MESSAGES,
    bad,
    chat_messages,
    system_messages,
)
from agentloop.gateway.dialects.messages_stream import error_body, render, render_stream
from agentloop.gateway.protocol import MAX_STOP, MAX_STOP_CHARS
from agentloop.gateway.turn import ToolChoice, TurnRequest

_INT64 = 2**63
_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")


__all__ = ["DIALECT", "MAX_MESSAGES", "count_tokens_body", "parse", "parse_count_tokens"]


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse(body: Any, state: dict[str, Any]) -> TurnRequest:
    """A Messages request body as a :class:`TurnRequest`.

    Args:
        body: the decoded JSON body.
        state: this dialect's per-session dict (unused: a request carries its whole history).
    Returns:
        the canonical request (``sampling`` holds ``max_tokens`` and the knobs the body sent).
    Raises:
        GatewayHTTPError: 400 naming the offending key for anything refused.
    """
    return _parse(body, count_only=False)


def parse_count_tokens(body: Any, state: dict[str, Any]) -> TurnRequest:
    """A ``/messages/count_tokens`` body (a Messages body without ``max_tokens``) as a
    :class:`TurnRequest`; raises :class:`GatewayHTTPError` 400 like :func:`parse`."""
    return _parse(body, count_only=True)


def count_tokens_body(input_tokens: int) -> dict[str, Any]:
    """The ``count_tokens`` reply: ``{"input_tokens": N}``."""
    return {"input_tokens": int(input_tokens)}


def _parse(body: Any, *, count_only: bool) -> TurnRequest:
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("a model name (a non-empty string) is required", "model")
    sampling = _sampling(body, count_only)
    tools = _tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"), tools)
    _check_options(body)
    stream = body.get("stream", False) if not count_only else False
    if not isinstance(stream, bool):
        raise bad("must be a boolean", "stream")
    messages = system_messages(body.get("system")) + chat_messages(body.get("messages"))
    return TurnRequest(
        model=model, messages=messages, tools=tools, sampling=sampling, stream=stream,
        tool_choice=tool_choice, response_format=_output_format(body.get("output_config")),
    )


# ---- sampling and options ----------------------------------------------------------------------
def _sampling(body: dict[str, Any], count_only: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    max_tokens = body.get("max_tokens")
    if not count_only:
        if max_tokens is None:
            raise bad("Field required (the most tokens to generate, >= 1)", "max_tokens")
        if not _int(max_tokens) or not 1 <= max_tokens < _INT64:
            raise bad(f"must be an integer >= 1, got {max_tokens!r}", "max_tokens")
        out["max_tokens"] = max_tokens
    temperature = body.get("temperature")
    if temperature is not None:
        if not _number(temperature) or not 0.0 <= temperature <= 1.0:
            raise bad(f"must be a number from 0 to 1, got {temperature!r}", "temperature")
        out["temperature"] = float(temperature)
    top_p = body.get("top_p")
    if top_p is not None:
        if not _number(top_p) or not 0.0 < top_p <= 1.0:
            raise bad(f"must be a number in (0, 1], got {top_p!r}", "top_p")
        out["top_p"] = float(top_p)
    top_k = body.get("top_k")
    if top_k is not None:
        if not _int(top_k) or not 0 <= top_k < _INT64:
            raise bad(f"must be an integer >= 0 (0: off), got {top_k!r}", "top_k")
        out["top_k"] = top_k
    stops = _stop_sequences(body.get("stop_sequences"))
    if stops:
        out["stop"] = stops
    return out


def _stop_sequences(raw: Any) -> list[str]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad("must be a list of strings", "stop_sequences")
    if len(raw) > MAX_STOP:
        raise bad(f"has {len(raw)} strings; send at most {MAX_STOP}", "stop_sequences")
    for i, s in enumerate(raw):
        if not isinstance(s, str) or not s:
            raise bad("every stop sequence must be a non-empty string", f"stop_sequences.{i}")
        if len(s) > MAX_STOP_CHARS:
            raise bad(
                f"has {len(s)} characters; the limit is {MAX_STOP_CHARS}", f"stop_sequences.{i}"
            )
    return list(raw)


def _check_options(body: dict[str, Any]) -> None:
    """``thinking`` and ``metadata`` are type-checked, not applied; ``service_tier`` is ignored."""
    thinking = body.get("thinking")
    if thinking is not None and (
        not isinstance(thinking, dict) or not isinstance(thinking.get("type"), str)
    ):
        raise bad('must be an object like {"type": "enabled", "budget_tokens": 2048}', "thinking")
    budget = (thinking or {}).get("budget_tokens")
    if budget is not None and not _int(budget):
        raise bad("must be an integer", "thinking.budget_tokens")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad("must be an object", "metadata")


def _output_format(raw: Any) -> dict[str, Any] | None:
    """``output_config.format`` (a JSON schema) as the canonical ``response_format``."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise bad("must be an object", "output_config")
    fmt = raw.get("format")
    if fmt is None:
        return None
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        raise bad('must be {"type": "json_schema", "schema": {...}}', "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


# ---- tools ---------------------------------------------------------------------------------------
def _tools(raw: Any) -> list[dict[str, Any]] | None:
    """Custom tools as chat-completions function tools; server tools (a ``type`` other than
    ``custom``) are refused."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad("must be a list of tools", "tools")
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(raw):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise bad("must be an object with name, description and input_schema", where)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise bad(
                f"type {kind!r} is a server tool; only custom tools (name, description, "
                "input_schema) are served by this gateway",
                f"{where}.type",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise bad(f"name must match ^[a-zA-Z0-9_-]{{1,128}}$, got {name!r}", f"{where}.name")
        if name in names:
            raise bad(f"tool names must be unique; {name!r} is given twice", f"{where}.name")
        names.add(name)
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise bad("input_schema (a JSON schema object) is required", f"{where}.input_schema")
        fn: dict[str, Any] = {"name": name}
        if tool.get("description") is not None:
            if not isinstance(tool["description"], str):
                raise bad("must be a string", f"{where}.description")
            fn["description"] = tool["description"]
        fn["parameters"] = schema
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(raw: Any, tools: list[dict[str, Any]] | None) -> ToolChoice:
    """``auto`` / ``any`` / ``tool`` / ``none`` as ``auto`` / ``required`` / a named function /
    ``none``; ``disable_parallel_tool_use`` is accepted and not applied."""
    if raw is None:
        return "auto"
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise bad('must be an object like {"type": "auto"}', "tool_choice")
    kind = raw["type"]
    parallel = raw.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("must be a boolean", "tool_choice.disable_parallel_tool_use")
    if kind in ("auto", "none"):
        return kind  # type: ignore[return-value]
    if kind not in ("any", "tool"):
        raise bad(f"type must be one of auto, any, tool, none; got {kind!r}", "tool_choice.type")
    if not tools:
        raise bad(f"tool_choice {kind!r} needs tools", "tool_choice")
    if kind == "any":
        return "required"
    name = raw.get("name")
    offered = [t["function"]["name"] for t in tools]
    if not isinstance(name, str) or name not in offered:
        raise bad(f"name must be one of the tools {offered}, got {name!r}", "tool_choice.name")
    return {"type": "function", "name": name}


_BLOCK_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {
            "type": "string",
            "enum": ["text", "image", "tool_use", "tool_result", "thinking"],
        },
        "text": {"type": "string"},
        "source": {"type": "object"},
        "id": {"type": "string"},
        "name": {"type": "string"},
        "input": {"type": "object"},
        "tool_use_id": {"type": "string"},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "is_error": {"type": "boolean"},
        "thinking": {"type": "string"},
        "signature": {"type": "string"},
    },
}
_BODY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["model", "max_tokens", "messages"],
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "max_tokens": {"type": "integer", "minimum": 1},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"type": "string", "enum": ["user", "assistant"]},
                    "content": {
                        "anyOf": [{"type": "string"}, {"type": "array", "items": _BLOCK_SCHEMA}]
                    },
                },
            },
        },
        "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "tools": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "input_schema"],
                "properties": {
                    "name": {"type": "string"}, "description": {"type": "string"},
                    "input_schema": {"type": "object"},
                },
            },
        },
        "tool_choice": {
            "type": "object",
            "required": ["type"],
            "properties": {
                "type": {"type": "string", "enum": ["auto", "any", "tool", "none"]},
                "name": {"type": "string"}, "disable_parallel_tool_use": {"type": "boolean"},
            },
        },
        "stop_sequences": {"type": "array", "maxItems": MAX_STOP, "items": {"type": "string"}},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0},
        "stream": {"type": "boolean"},
        "metadata": {"type": "object"},
        "thinking": {"type": "object"},
        "output_config": {"type": "object"},
    },
}


DIALECT = Dialect(
    name="messages",
    path="/messages",
    parse=parse,
    render=render,
    render_stream=render_stream,
    error_body=error_body,
    parse_count=parse_count_tokens,
    render_count=count_tokens_body,
    openapi={
        "requestBody": {"required": True, "content": {"application/json": {"schema": _BODY_SCHEMA}}}
    },
)
"""The Anthropic Messages API on ``POST /sessions/{id}/v1/messages`` (and ``.../count_tokens``)."""
