"""Llama 3.x JSON tool calls: the whole response is ``{"name": ..., "parameters": {...}}``.

Format (Llama 3.1-3.3 with JSON tool calling)::

    <|python_tag|>{"name": "NAME", "parameters": {"p": 1}}; {"name": "OTHER", "parameters": {}}

``<|python_tag|>`` is optional (a special token, dropped by ``skip_special_tokens``; a literal one
at the start is skipped too).  ``"arguments"`` is accepted for ``"parameters"`` and a JSON-encoded
object string for the object; a missing one means ``{}``.  Several calls are separated by ``;``
(what our ``llama3_json`` template writes for parallel calls); whitespace alone between objects is
accepted too.

A response that does not start with ``{`` (after whitespace and the tag) is plain content with no
calls; one that does is all calls, so its content is empty.  Invalid JSON, an object without a
string ``name``, non-object parameters, text after the last object, or a tool not in ``tools`` (when
given) gives a call with ``error`` set; nothing raises.
"""

from __future__ import annotations

import json
from typing import Any

from agentloop.parsers.base import FunctionCall, ToolParser, tool_names, unknown_tool_error

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def _to_call(obj: Any, raw: str, allowed: set[str] | None) -> FunctionCall:
    """A call from one decoded JSON value (``raw`` is its text)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return FunctionCall(name="", arguments=raw, error="tool call needs a string 'name'")
    name = obj["name"]
    args: Any = obj.get("parameters", obj.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return FunctionCall(
                name=name, arguments=args, error="'parameters' is not a JSON object"
            )
    if not isinstance(args, dict):
        return FunctionCall(
            name=name, arguments=json.dumps(args), error="'parameters' must be an object"
        )
    call = FunctionCall(name=name, arguments=json.dumps(args, ensure_ascii=False))
    if allowed is not None and name not in allowed:
        call.error = unknown_tool_error(name, allowed)
    return call


def _next_call_start(body: str, pos: int) -> int:
    """Skip whitespace, at most one ``;`` and whitespace after a call; the index reached."""
    while pos < len(body) and body[pos].isspace():
        pos += 1
    if pos < len(body) and body[pos] == ";":
        pos += 1
    while pos < len(body) and body[pos].isspace():
        pos += 1
    return pos


def _parse_calls(body: str, allowed: set[str] | None) -> list[FunctionCall]:
    """All calls in ``body`` (which starts with ``{``)."""
    calls: list[FunctionCall] = []
    pos = 0
    while pos < len(body):
        if body[pos] != "{":
            error = "unexpected text after the tool call(s); separate calls with ';'"
            calls.append(FunctionCall(name="", arguments=body[pos:].strip(), error=error))
            break
        try:
            obj, end = _DECODER.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            error = f"tool call is not valid JSON: {e.msg}"
            calls.append(FunctionCall(name="", arguments=body[pos:].strip(), error=error))
            break
        calls.append(_to_call(obj, body[pos:end], allowed))
        pos = _next_call_start(body, end)
    return calls


@ToolParser.register("llama3_json")
class Llama3JsonToolParser(ToolParser):
    """Parser for Llama 3.x JSON tool calls (``{"name": ..., "parameters": ...}``,
    ``;``-separated)."""

    tool_call_start = "{"

    def parse_text(
        self, text: str, tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        """The parsing itself, on decoded text."""
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        if not body.startswith("{"):
            return body, []
        allowed = tool_names(tools)
        return "", _parse_calls(body, allowed)
