"""Gemma 4 tool calls: ``<|tool_call>call:NAME{key:value,...}<tool_call|>`` (verl's ``gemma4``).

Format (the markers and the string quote ``<|"|>`` are special tokens)::

    <|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,days:3}<tool_call|>

Arguments are ``key:value`` pairs separated by ``,``: a value is a string between ``<|"|>`` quotes
(taken verbatim), an object ``{...}`` or an array ``[...]`` of values, or a bare word: ``true`` /
``false`` / ``null``, a number, else the word as a string.  Content is the text outside the calls
(special tokens dropped, stripped).  Gemma 4 keeps generating after a call instead of ending its
turn, so ``<tool_call|>`` is a stop token (verl's rule).  A call without ``call:NAME{``, arguments
that do not parse, an unclosed call or a tool not in ``tools`` gives a call with ``error``.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from agentloop.parsers.base import (
    FunctionCall,
    ToolParser,
    split_blocks,
    tool_names,
    unknown_tool_error,
)

CALL_START, CALL_END, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_HEAD = re.compile(r"\s*call:([\w.-]+)\s*(?=\{)")
_KEY = re.compile(r"\s*([\w.-]+)\s*:")
_BARE = re.compile(r"[^,{}\[\]]*")


class _Syntax(ValueError):
    """Arguments that do not follow the format (the message says where)."""


def _bare(word: str) -> Any:
    word = word.strip()
    lowered = word.lower()
    if lowered in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[lowered]
    for kind in (int, float):
        try:
            number = kind(word)
        except ValueError:
            continue
        return number if math.isfinite(number) else word
    return word


def _value(text: str, pos: int) -> tuple[Any, int]:
    """The value starting at ``pos`` (after whitespace) and the index after it."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    if text.startswith(QUOTE, pos):
        end = text.find(QUOTE, pos + len(QUOTE))
        if end < 0:
            raise _Syntax(f"string at {pos} is not closed with {QUOTE}")
        return text[pos + len(QUOTE):end], end + len(QUOTE)
    if text.startswith("{", pos):
        return _object(text, pos)
    if text.startswith("[", pos):
        items: list[Any] = []
        pos += 1
        while not text[pos:].lstrip().startswith("]"):
            item, pos = _value(text, pos)
            items.append(item)
            pos = _separator(text, pos, "]")
        return items, text.index("]", pos) + 1
    match = _BARE.match(text, pos)
    assert match is not None  # the pattern matches the empty string
    return _bare(match.group()), match.end()


def _separator(text: str, pos: int, close: str) -> int:
    """Skip a ``,`` after an item (none before ``close``); raises at anything else."""
    rest = text[pos:].lstrip()
    if rest.startswith(","):
        return text.index(",", pos) + 1
    if rest.startswith(close):
        return pos
    raise _Syntax(f"expected ',' or {close!r} at {pos}, got {rest[:20]!r}")


def _object(text: str, pos: int) -> tuple[dict[str, Any], int]:
    """The ``{key:value,...}`` object starting at ``pos`` and the index after it."""
    out: dict[str, Any] = {}
    pos += 1
    while not text[pos:].lstrip().startswith("}"):
        key = _KEY.match(text, pos)
        if key is None:
            raise _Syntax(f"expected 'key:' at {pos}, got {text[pos:pos + 20]!r}")
        out[key.group(1)], pos = _value(text, key.end())
        pos = _separator(text, pos, "}")
        if pos >= len(text):
            raise _Syntax("object is not closed with '}'")
    return out, text.index("}", pos) + 1


def _parse_call(body: str, allowed: set[str] | None) -> FunctionCall:
    head = _HEAD.match(body)
    if head is None:
        return FunctionCall(
            name="", arguments=body.strip(), error="tool call needs 'call:NAME{...}'"
        )
    name = head.group(1)
    try:
        args, end = _object(body, head.end())
        if body[end:].strip():
            raise _Syntax(f"unexpected text after the arguments: {body[end:].strip()[:20]!r}")
    except (_Syntax, ValueError, IndexError) as e:
        return FunctionCall(
            name=name, arguments=body[head.end() :].strip(), error=f"arguments do not parse: {e}"
        )
    error = (
        unknown_tool_error(name, allowed) if allowed is not None and name not in allowed else None
    )
    return FunctionCall(name=name, arguments=json.dumps(args, ensure_ascii=False), error=error)


@ToolParser.register("gemma4")
class Gemma4ToolParser(ToolParser):
    """Parser for Gemma 4's ``<|tool_call>call:NAME{...}<tool_call|>`` format."""

    tool_call_start = None  # the markers are special tokens, which streaming decodes away: hold all
    skip_special_tokens = False
    stop_tokens = (CALL_END,)
    markup_tokens = (CALL_START, CALL_END, QUOTE)

    def parse_text(
        self, text: str, tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        """The parsing itself, on text decoded with the special tokens."""
        allowed = tool_names(tools)
        content, bodies, unclosed = split_blocks(text, CALL_START, CALL_END)
        calls = [_parse_call(body, allowed) for body in bodies]
        if unclosed is not None:
            call = _parse_call(unclosed, allowed)
            call.error = "; ".join(
                e for e in (f"tool call is not closed with {CALL_END}", call.error) if e
            )
            calls.append(call)
        return self.without_special_tokens(content).strip(), calls
