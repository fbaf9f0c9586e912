"""Canonical form of chat messages: what makes two requests' turns the same in the session trie.

Spec: docs/gateway.md#the-trie (canonical messages) and docs/gateway.md#reasoning (reasoning).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

Canon = tuple[Any, ...]
_TEXT_PARTS = ("text", "input_text", "output_text")
_IMAGE_PARTS = ("image_url", "input_image", "image")


def _image_ref(part: dict[str, Any]) -> str:
    value = part.get(part.get("type") or "image_url", part.get("url"))
    if isinstance(value, dict):
        value = value.get("url", value)
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def _canonical_content(content: Any) -> Any:
    """A string for text (``None``, ``""`` and text parts included); a tuple with image markers
    otherwise."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        return ("value", json.dumps(content, sort_keys=True, default=str))
    pieces: list[Any] = [""]
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(part, dict) and kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            if isinstance(pieces[-1], str):
                pieces[-1] += part["text"]
            else:
                pieces.append(part["text"])
        elif isinstance(part, dict) and kind in _IMAGE_PARTS:
            pieces.append(("image", _image_ref(part)))
        else:
            pieces.append(("part", json.dumps(part, sort_keys=True, default=str)))
    if len(pieces) == 1:
        return pieces[0]
    return tuple(p for p in pieces if p != "")


def _canonical_arguments(arguments: Any) -> tuple[str, str]:
    """Parsed JSON (dumped with sorted keys), or the stripped string when it is not JSON."""
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        text = arguments.strip()
        if not text:
            arguments = {}
        else:
            try:
                arguments = json.loads(text)
            except ValueError:
                return ("text", text)
    return ("json", json.dumps(arguments, sort_keys=True, ensure_ascii=False, default=str))


def _canonical_tool_calls(calls: Any) -> tuple[tuple[Any, tuple[str, str]], ...]:
    out = []
    for call in calls or ():
        fn = call.get("function", call) if isinstance(call, dict) else {}
        fn = fn if isinstance(fn, dict) else {}
        out.append((fn.get("name"), _canonical_arguments(fn.get("arguments"))))
    return tuple(out)


def _canonical_reasoning(msg: dict[str, Any]) -> str:
    """An assistant message's ``reasoning_content``, stripped ("" when absent or not a string)."""
    reasoning = msg.get("reasoning_content")
    return reasoning.strip() if isinstance(reasoning, str) else ""


def canonical_message(msg: dict[str, Any]) -> Canon:
    """Hashable form of an OpenAI message: ``(role, content, name, tool_calls, reasoning)``
    (docs/gateway.md#the-trie)."""
    return (msg.get("role"), _canonical_content(msg.get("content")), msg.get("name") or None,
            _canonical_tool_calls(msg.get("tool_calls")), _canonical_reasoning(msg))


def canonical_tools(tools: Sequence[dict[str, Any]] | None) -> str:
    """The tools list as sorted-keys JSON (``None`` == ``[]``)."""
    return json.dumps(list(tools or []), sort_keys=True, ensure_ascii=False, default=str)
