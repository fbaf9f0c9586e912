"""Kimi K2 tool calls: special-token sections with ``functions.NAME:IDX`` call ids (verl's
``kimi``).

Format (every marker is a special token)::

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>
    <|tool_calls_section_end|>

The text between ``<|tool_call_begin|>`` and ``<|tool_call_argument_begin|>`` is the call id, kept
as :attr:`FunctionCall.id` / ``tool_call_id`` (Kimi's chat template renders it back); the tool name
is the id without the ``functions.`` prefix and the ``:IDX`` suffix.  Arguments must be a JSON
object. Content is the text outside the section (special tokens dropped, stripped).  ``<|im_end|>``
is a stop token (verl's rule).  Invalid JSON, a non-object, a call not closed by
``<|tool_call_end|>``, an empty name, or a tool not in ``tools`` gives a call with ``error``; a
section left open is parsed as far as it goes.
"""

from __future__ import annotations

import json
from typing import Any

from agentloop.parsers.base import (
    FunctionCall,
    ToolParser,
    split_blocks,
    tool_names,
    unknown_tool_error,
)

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGS_BEGIN, CALL_END = (
    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
)


def tool_name_of(call_id: str) -> str:
    """``functions.get_weather:0`` → ``get_weather`` (ids in another shape lose only what
    matches)."""
    name = call_id.strip()
    name = name.removeprefix("functions.")
    head, sep, index = name.rpartition(":")
    return head if sep and index.isdigit() else name


def _parse_call(body: str, closed: bool, allowed: set[str] | None) -> FunctionCall:
    call_id, sep, raw = body.partition(ARGS_BEGIN)
    name = tool_name_of(call_id)
    fields: dict[str, Any] = {"name": name, "arguments": raw.strip()}
    if call_id.strip():
        fields["id"] = call_id.strip()
    if not closed:
        return FunctionCall(**fields, error=f"tool call is not closed with {CALL_END}")
    if not sep or not name:
        return FunctionCall(
            **fields, error=f"tool call needs 'functions.NAME:IDX{ARGS_BEGIN}{{...}}'"
        )
    try:
        args = json.loads(raw)
    except json.JSONDecodeError as e:
        return FunctionCall(**fields, error=f"tool call arguments are not valid JSON: {e.msg}")
    if not isinstance(args, dict):
        return FunctionCall(**fields, error="tool call arguments must be a JSON object")
    fields["arguments"] = json.dumps(args, ensure_ascii=False)
    error = (
        unknown_tool_error(name, allowed) if allowed is not None and name not in allowed else None
    )
    return FunctionCall(**fields, error=error)


@ToolParser.register("kimi")
class KimiToolParser(ToolParser):
    """Parser for Kimi K2's ``<|tool_calls_section_begin|>`` sections."""

    tool_call_start = None  # the markers are special tokens, which streaming decodes away: hold all
    skip_special_tokens = False
    stop_tokens = ("<|im_end|>",)
    markup_tokens = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGS_BEGIN, CALL_END)

    def parse_text(
        self, text: str, tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        """The parsing itself, on text decoded with the special tokens."""
        allowed = tool_names(tools)
        content, sections, unclosed = split_blocks(text, SECTION_BEGIN, SECTION_END)
        calls: list[FunctionCall] = []
        for section in [*sections, *([unclosed] if unclosed is not None else [])]:
            _, bodies, open_call = split_blocks(section, CALL_BEGIN, CALL_END)
            calls += [_parse_call(body, True, allowed) for body in bodies]
            if open_call is not None:
                calls.append(_parse_call(open_call, False, allowed))
        return self.without_special_tokens(content).strip(), calls
