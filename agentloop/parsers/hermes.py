"""Hermes / Qwen2.5 tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

Content is the text outside the blocks (stripped).  Each block must hold one JSON object with a
string ``name`` and an object ``arguments`` (a JSON-encoded object string is accepted too).  A block
that is not valid JSON, lacks a name, names a tool not in ``tools`` (when given), or is left
unclosed comes back as a call with ``error`` set.
"""

from __future__ import annotations

import json
import re
from typing import Any

from agentloop.parsers.base import FunctionCall, ToolParser, tool_names, unknown_tool_error
from agentloop.types import unchecked

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _parse_block(body: str, allowed: set[str] | None) -> FunctionCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return FunctionCall(
            name="", arguments=body.strip(), error=f"tool call is not valid JSON: {e.msg}"
        )
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return FunctionCall(
            name="", arguments=body.strip(), error="tool call needs a string 'name'"
        )
    args: Any = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return FunctionCall(
                name=obj["name"], arguments=args, error="'arguments' is not a JSON object"
            )
    if not isinstance(args, dict):
        return FunctionCall(
            name=obj["name"], arguments=json.dumps(args), error="'arguments' must be an object"
        )
    # both strings: built unchecked (types.unchecked), the id from the field's factory
    call = unchecked(FunctionCall, name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))
    if allowed is not None and call.name not in allowed:
        call.error = unknown_tool_error(call.name, allowed)
    return call


@ToolParser.register("hermes")
class HermesToolParser(ToolParser):
    """Parser for the hermes ``<tool_call>`` JSON format (Qwen2.5, our tiny model)."""

    tool_call_start = "<tool_call>"

    def parse_text(
        self, text: str, tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        """The parsing itself, on decoded text."""
        allowed = tool_names(tools)
        calls = [_parse_block(m.group(1), allowed) for m in _BLOCK.finditer(text)]
        content = _BLOCK.sub("", text)
        if "<tool_call>" in content:  # an opened block that never closed
            head, _, tail = content.partition("<tool_call>")
            calls.append(
                FunctionCall(
                    name="", arguments=tail.strip(), error="<tool_call> block is not closed"
                )
            )
            content = head
        return content.strip(), calls
