"""The Anthropic Messages dialect: ``POST /sessions/{id}/v1/messages`` and ``.../count_tokens``.

:func:`parse` checks a Messages request body and translates it into the gateway's canonical
:class:`~agentloop.gateway.turn.TurnRequest` (chat-shaped messages and function tools); anything
refused is a :class:`~agentloop.gateway.protocol.GatewayHTTPError` 400 whose ``param`` names the
offending key (``messages.2.content.0.tool_use_id``), rendered in Anthropic's error shape by
:func:`~agentloop.gateway.dialects.messages_stream.error_body`.  The reply side (the ``message``
object, its event stream, errors) is :mod:`agentloop.gateway.dialects.messages_stream`.
Spec (what maps to what, what is refused and why): docs/gateway.md#dialects.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from agentloop.gateway.dialects.base import Dialect
from agentloop.gateway.dialects.messages_stream import error_body, render, render_stream
from agentloop.gateway.images import ImagePartError, data_url, image_url_part
from agentloop.gateway.protocol import MAX_STOP, MAX_STOP_CHARS, GatewayHTTPError
from agentloop.gateway.turn import ToolChoice, TurnRequest

MAX_MESSAGES = 100_000
"""Most messages one request may send (Anthropic's limit)."""
_INT64 = 2**63
_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")
_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
_USER_BLOCKS = ("text", "image", "tool_result")
_ASSISTANT_BLOCKS = ("text", "thinking", "tool_use")


def _bad(message: str, param: str | None = None) -> GatewayHTTPError:
    return GatewayHTTPError(400, f"{param}: {message}" if param else message, param=param)


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
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("a model name (a non-empty string) is required", "model")
    sampling = _sampling(body, count_only)
    tools = _tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"), tools)
    _check_options(body)
    stream = body.get("stream", False) if not count_only else False
    if not isinstance(stream, bool):
        raise _bad("must be a boolean", "stream")
    messages = _system(body.get("system")) + _messages(body.get("messages"))
    return TurnRequest(
        model=model,
        messages=messages,
        tools=tools,
        sampling=sampling,
        stream=stream,
        tool_choice=tool_choice,
        response_format=_output_format(body.get("output_config")),
    )


# ---- sampling and options ----------------------------------------------------------------------
def _sampling(body: dict[str, Any], count_only: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    max_tokens = body.get("max_tokens")
    if not count_only:
        if max_tokens is None:
            raise _bad("Field required (the most tokens to generate, >= 1)", "max_tokens")
        if not _int(max_tokens) or not 1 <= max_tokens < _INT64:
            raise _bad(f"must be an integer >= 1, got {max_tokens!r}", "max_tokens")
        out["max_tokens"] = max_tokens
    temperature = body.get("temperature")
    if temperature is not None:
        if not _number(temperature) or not 0.0 <= temperature <= 1.0:
            raise _bad(f"must be a number from 0 to 1, got {temperature!r}", "temperature")
        out["temperature"] = float(temperature)
    top_p = body.get("top_p")
    if top_p is not None:
        if not _number(top_p) or not 0.0 < top_p <= 1.0:
            raise _bad(f"must be a number in (0, 1], got {top_p!r}", "top_p")
        out["top_p"] = float(top_p)
    top_k = body.get("top_k")
    if top_k is not None:
        if not _int(top_k) or not 0 <= top_k < _INT64:
            raise _bad(f"must be an integer >= 0 (0: off), got {top_k!r}", "top_k")
        out["top_k"] = top_k
    stops = _stop_sequences(body.get("stop_sequences"))
    if stops:
        out["stop"] = stops
    return out


def _stop_sequences(raw: Any) -> list[str]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _bad("must be a list of strings", "stop_sequences")
    if len(raw) > MAX_STOP:
        raise _bad(f"has {len(raw)} strings; send at most {MAX_STOP}", "stop_sequences")
    for i, s in enumerate(raw):
        if not isinstance(s, str) or not s:
            raise _bad("every stop sequence must be a non-empty string", f"stop_sequences.{i}")
        if len(s) > MAX_STOP_CHARS:
            raise _bad(
                f"has {len(s)} characters; the limit is {MAX_STOP_CHARS}", f"stop_sequences.{i}"
            )
    return list(raw)


def _check_options(body: dict[str, Any]) -> None:
    """``thinking`` and ``metadata`` are type-checked, not applied; ``service_tier`` is ignored."""
    thinking = body.get("thinking")
    if thinking is not None and (
        not isinstance(thinking, dict) or not isinstance(thinking.get("type"), str)
    ):
        raise _bad('must be an object like {"type": "enabled", "budget_tokens": 2048}', "thinking")
    budget = (thinking or {}).get("budget_tokens")
    if budget is not None and not _int(budget):
        raise _bad("must be an integer", "thinking.budget_tokens")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise _bad("must be an object", "metadata")


def _output_format(raw: Any) -> dict[str, Any] | None:
    """``output_config.format`` (a JSON schema) as the canonical ``response_format``."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise _bad("must be an object", "output_config")
    fmt = raw.get("format")
    if fmt is None:
        return None
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        raise _bad('must be {"type": "json_schema", "schema": {...}}', "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


# ---- tools ---------------------------------------------------------------------------------------
def _tools(raw: Any) -> list[dict[str, Any]] | None:
    """Custom tools as chat-completions function tools; server tools (a ``type`` other than
    ``custom``) are refused."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise _bad("must be a list of tools", "tools")
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(raw):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise _bad("must be an object with name, description and input_schema", where)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise _bad(
                f"type {kind!r} is a server tool; only custom tools (name, description, "
                "input_schema) are served by this gateway",
                f"{where}.type",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise _bad(f"name must match ^[a-zA-Z0-9_-]{{1,128}}$, got {name!r}", f"{where}.name")
        if name in names:
            raise _bad(f"tool names must be unique; {name!r} is given twice", f"{where}.name")
        names.add(name)
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad("input_schema (a JSON schema object) is required", f"{where}.input_schema")
        fn: dict[str, Any] = {"name": name}
        if tool.get("description") is not None:
            if not isinstance(tool["description"], str):
                raise _bad("must be a string", f"{where}.description")
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
        raise _bad('must be an object like {"type": "auto"}', "tool_choice")
    kind = raw["type"]
    parallel = raw.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("must be a boolean", "tool_choice.disable_parallel_tool_use")
    if kind in ("auto", "none"):
        return kind  # type: ignore[return-value]
    if kind not in ("any", "tool"):
        raise _bad(f"type must be one of auto, any, tool, none; got {kind!r}", "tool_choice.type")
    if not tools:
        raise _bad(f"tool_choice {kind!r} needs tools", "tool_choice")
    if kind == "any":
        return "required"
    name = raw.get("name")
    offered = [t["function"]["name"] for t in tools]
    if not isinstance(name, str) or name not in offered:
        raise _bad(f"name must be one of the tools {offered}, got {name!r}", "tool_choice.name")
    return {"type": "function", "name": name}


# ---- messages ------------------------------------------------------------------------------------
def _text_of(content: Any, where: str) -> str:
    """A string, or a list of text blocks joined (system prompts, tool results)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("must be a string or a list of text blocks", where)
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise _bad(f"only text blocks are accepted here, got {_kind(block)}", f"{where}.{j}")
        texts.append(_text(block, f"{where}.{j}"))
    return "".join(texts)


def _kind(block: Any) -> str:
    if not isinstance(block, dict):
        return f"a {type(block).__name__}"
    return f"a block of type {block.get('type')!r}"


def _text(block: dict[str, Any], where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise _bad("a text block needs a string 'text'", f"{where}.text")
    return block["text"]


def _system(raw: Any) -> list[dict[str, Any]]:
    """``system`` (a string or text blocks) as the first message; an empty one adds nothing."""
    if raw is None:
        return []
    text = _text_of(raw, "system")
    return [{"role": "system", "content": text}] if text else []


@dataclass
class _Turn:
    """Consecutive messages of one role (Anthropic combines them into one turn)."""

    role: str
    index: int
    blocks: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    """``(param path, block)`` in order."""


def _turns(raw: Any) -> list[_Turn]:
    """The checked messages as turns: consecutive user (or assistant) messages merged."""
    if not isinstance(raw, list):
        raise _bad("must be a list of messages", "messages")
    if not raw:
        raise _bad("at least one message is required", "messages")
    if len(raw) > MAX_MESSAGES:
        raise _bad(f"has {len(raw)} messages; the limit is {MAX_MESSAGES}", "messages")
    turns: list[_Turn] = []
    for i, msg in enumerate(raw):
        where = f"messages.{i}"
        if not isinstance(msg, dict):
            raise _bad("must be an object with role and content", where)
        role = msg.get("role")
        if role not in ("user", "assistant", "system"):
            raise _bad(f"role must be 'user' or 'assistant', got {role!r}", f"{where}.role")
        content = msg.get("content")
        if role == "system":
            turns.append(
                _Turn(
                    "system",
                    i,
                    [(f"{where}.content", {"text": _text_of(content, f"{where}.content")})],
                )
            )
            continue
        blocks = _blocks(content, f"{where}.content", role)
        if turns and turns[-1].role == role:
            turns[-1].blocks.extend(blocks)
        else:
            turns.append(_Turn(role, i, blocks))
    _check_order(turns)
    return turns


def _blocks(content: Any, where: str, role: str) -> list[tuple[str, dict[str, Any]]]:
    if isinstance(content, str):
        return [(where, {"type": "text", "text": content})]
    if not isinstance(content, list):
        raise _bad("must be a string or a list of content blocks", where)
    if not content and role == "user":
        raise _bad("a user message needs content", where)
    allowed = _USER_BLOCKS if role == "user" else _ASSISTANT_BLOCKS
    out = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "redacted_thinking":
            raise _bad(
                "redacted_thinking blocks are not accepted: this gateway never produces them "
                "and their encrypted data cannot be rendered for the policy; remove them",
                f"{where}.{j}",
            )
        if kind not in allowed:
            raise _bad(
                f"{_kind(block)} is not accepted in a {role} message; "
                f"accepted: {', '.join(allowed)}",
                f"{where}.{j}.type",
            )
        out.append((f"{where}.{j}", block))
    return out


def _check_order(turns: list[_Turn]) -> None:
    talk = [t for t in turns if t.role != "system"]
    if not talk or talk[0].role != "user":
        where = f"messages.{talk[0].index}" if talk else "messages"
        raise _bad("the first message must use the user role", where)
    if talk[-1].role != "user":
        raise _bad(
            "the last message must use the user role (prefilling the assistant's reply is not "
            "supported: the policy samples the whole turn)",
            f"messages.{talk[-1].index}",
        )


def _messages(raw: Any) -> list[dict[str, Any]]:
    """Turns as canonical chat messages (docs/gateway.md#dialects)."""
    out: list[dict[str, Any]] = []
    call_ids: set[str] = set()
    for turn in _turns(raw):
        if turn.role == "system":
            out.append({"role": "system", "content": turn.blocks[0][1]["text"]})
        elif turn.role == "assistant":
            out.append(_assistant(turn, call_ids))
        else:
            out.extend(_user(turn, call_ids))
    return out


def _assistant(turn: _Turn, call_ids: set[str]) -> dict[str, Any]:
    """One assistant turn: text joined, thinking as ``reasoning_content``, tool_use blocks as
    ``tool_calls``."""
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for where, block in turn.blocks:
        kind = block["type"]
        if kind == "text":
            texts.append(_text(block, where))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise _bad("a thinking block needs a string 'thinking'", f"{where}.thinking")
            if block.get("signature") is not None and not isinstance(block["signature"], str):
                raise _bad("must be a string", f"{where}.signature")
            thinking.append(block["thinking"])
        else:
            calls.append(_tool_use(block, where, call_ids))
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    return message


def _tool_use(block: dict[str, Any], where: str, call_ids: set[str]) -> dict[str, Any]:
    call_id, name, args = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not call_id:
        raise _bad("a tool_use block needs a non-empty string 'id'", f"{where}.id")
    if call_id in call_ids:
        raise _bad(f"tool_use id {call_id!r} is used twice in this conversation", f"{where}.id")
    if not isinstance(name, str) or not name:
        raise _bad("a tool_use block needs a non-empty string 'name'", f"{where}.name")
    if not isinstance(args, dict):
        raise _bad("a tool_use block needs 'input', a JSON object", f"{where}.input")
    call_ids.add(call_id)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _user(turn: _Turn, call_ids: set[str]) -> list[dict[str, Any]]:
    """One user turn: its tool_result blocks (which must come first) as tool messages, in order,
    then its text and image blocks as one user message."""
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for where, block in turn.blocks:
        if block["type"] == "tool_result":
            if parts:
                raise _bad(
                    "tool_result blocks must come before any text or image in a user turn", where
                )
            tools.append(_tool_result(block, where, call_ids))
        elif block["type"] == "text":
            parts.append({"type": "text", "text": _text(block, where)})
        else:
            parts.append(_image(block, where))
    if not parts:
        return tools
    if all(p["type"] == "text" for p in parts):
        return [*tools, {"role": "user", "content": "".join(p["text"] for p in parts)}]
    return [*tools, {"role": "user", "content": parts}]


def _tool_result(block: dict[str, Any], where: str, call_ids: set[str]) -> dict[str, Any]:
    """A tool message; ``is_error`` is checked and not rendered (the content is kept as sent)."""
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or call_id not in call_ids:
        raise _bad(
            f"tool_use_id {call_id!r} matches no earlier tool_use block", f"{where}.tool_use_id"
        )
    if block.get("is_error") is not None and not isinstance(block["is_error"], bool):
        raise _bad("must be a boolean", f"{where}.is_error")
    content = block.get("content")
    if isinstance(content, list) and any(
        isinstance(b, dict) and b.get("type") == "image" for b in content
    ):
        raise _bad(
            "image blocks inside a tool_result are not supported; send the image in a user turn",
            f"{where}.content",
        )
    text = "" if content is None else _text_of(content, f"{where}.content")
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An image block as a chat ``image_url`` part with a base64 data URL (docs/gateway.md#images:
    the gateway never fetches a URL, so ``url`` sources other than data URLs are refused)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if media not in _MEDIA_TYPES:
            raise _bad(
                f"media_type must be one of {list(_MEDIA_TYPES)}, got {media!r}",
                f"{where}.source.media_type",
            )
        if not isinstance(data, str) or not data:
            raise _bad("must be a non-empty base64 string", f"{where}.source.data")
        url = data_url(media, data)
    elif kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise _bad("must be a non-empty string", f"{where}.source.url")
    else:
        raise _bad(
            f'an image source must be {{"type": "base64", ...}}, got {kind!r} (file sources need '
            "Anthropic's Files API, which this gateway does not serve)",
            f"{where}.source",
        )
    try:
        return image_url_part({"type": "image_url", "image_url": {"url": url}}, where)
    except ImagePartError as e:
        raise GatewayHTTPError(400, str(e), param=e.param) from None


DIALECT = Dialect(
    name="messages",
    path="/messages",
    parse=parse,
    render=render,
    render_stream=render_stream,
    error_body=error_body,
)
"""The Anthropic Messages dialect (``count_tokens``: :func:`parse_count_tokens`,
:func:`count_tokens_body`)."""
