"""Anthropic Messages ``messages`` and content blocks as the gateway's canonical chat messages.

Part of the Messages dialect (:mod:`agentloop.gateway.dialects.messages`): consecutive turns of
one role are combined (as Anthropic does); ``tool_use`` blocks become ``tool_calls``,
``tool_result`` blocks tool messages (before the turn's text), ``thinking`` blocks
``reasoning_content`` and ``image`` blocks chat ``image_url`` parts with base64 data URLs.  Every
refusal is a :class:`~agentloop.gateway.protocol.GatewayHTTPError` 400 naming the message or block
(``messages.2.content.0.tool_use_id``).  Spec: docs/gateway.md#dialects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentloop.gateway.images import ImagePartError, data_url, image_url_part
from agentloop.gateway.protocol import GatewayHTTPError

MAX_MESSAGES = 100_000
"""Most messages one request may send (Anthropic's limit)."""
_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
_USER_BLOCKS = ("text", "image", "tool_result")
_ASSISTANT_BLOCKS = ("text", "thinking", "tool_use")


def bad(message: str, param: str | None = None) -> GatewayHTTPError:
    """A 400 whose message starts with the offending key (``param``) when there is one."""
    return GatewayHTTPError(400, f"{param}: {message}" if param else message, param=param)


def _text_of(content: Any, where: str) -> str:
    """A string, or a list of text blocks joined (system prompts, tool results)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad("must be a string or a list of text blocks", where)
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise bad(f"only text blocks are accepted here, got {_kind(block)}", f"{where}.{j}")
        texts.append(_text(block, f"{where}.{j}"))
    return "".join(texts)


def _kind(block: Any) -> str:
    if not isinstance(block, dict):
        return f"a {type(block).__name__}"
    return f"a block of type {block.get('type')!r}"


def _text(block: dict[str, Any], where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise bad("a text block needs a string 'text'", f"{where}.text")
    return block["text"]


def system_messages(raw: Any) -> list[dict[str, Any]]:
    """``system`` (a string or text blocks) as the first message; an empty one adds nothing.

    Raises:
        GatewayHTTPError: 400 for anything but a string or text blocks.
    """
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
        raise bad("must be a list of messages", "messages")
    if not raw:
        raise bad("at least one message is required", "messages")
    if len(raw) > MAX_MESSAGES:
        raise bad(f"has {len(raw)} messages; the limit is {MAX_MESSAGES}", "messages")
    turns: list[_Turn] = []
    for i, msg in enumerate(raw):
        where = f"messages.{i}"
        if not isinstance(msg, dict):
            raise bad("must be an object with role and content", where)
        role = msg.get("role")
        if role not in ("user", "assistant", "system"):
            raise bad(f"role must be 'user' or 'assistant', got {role!r}", f"{where}.role")
        content = msg.get("content")
        if role == "system":
            turns.append(
                _Turn(
                    "system", i,
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
        raise bad("must be a string or a list of content blocks", where)
    if not content and role == "user":
        raise bad("a user message needs content", where)
    allowed = _USER_BLOCKS if role == "user" else _ASSISTANT_BLOCKS
    out = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "redacted_thinking":
            raise bad(
                "redacted_thinking blocks are not accepted: this gateway never produces them "
                "and their encrypted data cannot be rendered for the policy; remove them",
                f"{where}.{j}",
            )
        if kind not in allowed:
            raise bad(
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
        raise bad("the first message must use the user role", where)
    if talk[-1].role != "user":
        raise bad(
            "the last message must use the user role (prefilling the assistant's reply is not "
            "supported: the policy samples the whole turn)",
            f"messages.{talk[-1].index}",
        )


def chat_messages(raw: Any) -> list[dict[str, Any]]:
    """``messages`` as canonical chat messages (docs/gateway.md#dialects).

    Raises:
        GatewayHTTPError: 400 naming the offending message or block.
    """
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
                raise bad("a thinking block needs a string 'thinking'", f"{where}.thinking")
            if block.get("signature") is not None and not isinstance(block["signature"], str):
                raise bad("must be a string", f"{where}.signature")
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
        raise bad("a tool_use block needs a non-empty string 'id'", f"{where}.id")
    if call_id in call_ids:
        raise bad(f"tool_use id {call_id!r} is used twice in this conversation", f"{where}.id")
    if not isinstance(name, str) or not name:
        raise bad("a tool_use block needs a non-empty string 'name'", f"{where}.name")
    if not isinstance(args, dict):
        raise bad("a tool_use block needs 'input', a JSON object", f"{where}.input")
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
                raise bad(
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
        raise bad(
            f"tool_use_id {call_id!r} matches no earlier tool_use block", f"{where}.tool_use_id"
        )
    if block.get("is_error") is not None and not isinstance(block["is_error"], bool):
        raise bad("must be a boolean", f"{where}.is_error")
    content = block.get("content")
    if isinstance(content, list) and any(
        isinstance(b, dict) and b.get("type") == "image" for b in content
    ):
        raise bad(
            "image blocks inside a tool_result are not supported; send the image in a user turn",
            f"{where}.content",
        )
    text = "" if content is None else _text_of(content, f"{where}.content")
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An image block as a chat ``image_url`` part with a base64 data URL (docs/gateway.md#images:
    the gateway never fetches a URL, so ``url`` sources other than data URLs are refused)."""
    found = block.get("source")
    source: dict[str, Any] = found if isinstance(found, dict) else {}
    kind = source.get("type")
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if media not in _MEDIA_TYPES:
            raise bad(
                f"media_type must be one of {list(_MEDIA_TYPES)}, got {media!r}",
                f"{where}.source.media_type",
            )
        if not isinstance(data, str) or not data:
            raise bad("must be a non-empty base64 string", f"{where}.source.data")
        url = data_url(media, data)
    elif kind == "url":
        given = source.get("url")
        if not isinstance(given, str) or not given:
            raise bad("must be a non-empty string", f"{where}.source.url")
        url = given
    else:
        raise bad(
            f'an image source must be {{"type": "base64", ...}}, got {kind!r} (file sources need '
            "Anthropic's Files API, which this gateway does not serve)",
            f"{where}.source",
        )
    try:
        return image_url_part({"type": "image_url", "image_url": {"url": url}}, where)
    except ImagePartError as e:
        raise GatewayHTTPError(400, str(e), param=e.param) from None
