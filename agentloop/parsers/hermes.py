"""Hermes / Qwen2.5 tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

Content is the text outside the blocks (stripped).  Each block must hold one JSON object with a string
``name`` and an object ``arguments`` (a JSON-encoded object string is accepted too).  A block that is
not valid JSON, lacks a name, names a tool not in ``tools`` (when given), or is left unclosed comes
back as a call with ``error`` set.
"""

from __future__ import annotations

import json
import re
from typing import Any

from agentloop.parsers.base import FunctionCall, ToolParser

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _parse_block(body: str, allowed: set[str] | None) -> FunctionCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return FunctionCall(name="", arguments=body.strip(), error=f"tool call is not valid JSON: {e.msg}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return FunctionCall(name="", arguments=body.strip(), error="tool call needs a string 'name'")
    args: Any = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return FunctionCall(name=obj["name"], arguments=args, error="'arguments' is not a JSON object")
    if not isinstance(args, dict):
        return FunctionCall(name=obj["name"], arguments=json.dumps(args), error="'arguments' must be an object")
    call = FunctionCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))
    if allowed is not None and call.name not in allowed:
        call.error = f"unknown tool {call.name!r}; available tools: {sorted(allowed)}"
    return call


@ToolParser.register("hermes")
class HermesToolParser(ToolParser):
    """Parser for the hermes ``<tool_call>`` JSON format (Qwen2.5, our tiny model)."""

    tool_call_start = "<tool_call>"

    async def extract_tool_calls(
        self, response_ids: list[int], tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        text = self.tokenizer.decode(response_ids, skip_special_tokens=True)
        return self.parse_text(text, tools)

    def parse_text(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str, list[FunctionCall]]:
        """The parsing itself, on decoded text."""
        allowed = None if tools is None else {str((t.get("function") or t).get("name")) for t in tools}
        calls = [_parse_block(m.group(1), allowed) for m in _BLOCK.finditer(text)]
        content = _BLOCK.sub("", text)
        if "<tool_call>" in content:  # an opened block that never closed
            head, _, tail = content.partition("<tool_call>")
            calls.append(FunctionCall(name="", arguments=tail.strip(), error="<tool_call> block is not closed"))
            content = head
        return content.strip(), calls
