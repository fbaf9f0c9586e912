"""GLM-4.5 / 4.6 tool calls:
``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>`` (``glm``).

Format (newlines between the elements are optional)::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Oslo</arg_value>
    </tool_call>

The name is the text before the first ``<arg_key>``; each key is followed by its value.  Values are
coerced as in :mod:`agentloop.parsers.qwen3_coder` (the schema's type, else JSON when the text
parses, else the text). Content is the text outside the blocks without a leading thinking block
(``<think>…</think>`` or a bare ``</think>``) and special tokens, stripped.  GLM does not end its
turn after a call by itself, so ``<|observation|>`` is a stop token (verl's rule).  A block without
a name, a key without a value, a repeated key, a value that does not fit its type, an unclosed block
or a tool not in ``tools`` gives a call with ``error``.
"""

from __future__ import annotations

import re
from typing import Any

from agentloop.parsers.base import FunctionCall, ToolParser, finish_call, split_blocks
from agentloop.parsers.qwen3_coder import coerce_arguments, tool_parameter_schemas

_START, _END = "<tool_call>", "</tool_call>"
_KEY = re.compile(r"<arg_key>(.*?)</arg_key>", re.DOTALL)
_VALUE = re.compile(r"\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_THINKING = re.compile(r"^\s*(?:<think>.*?</think>|</think>)", re.DOTALL)


def _pairs(body: str) -> tuple[list[tuple[str, str]], list[str]]:
    """The (key, raw value) pairs after the name, and what was wrong with them."""
    pairs: list[tuple[str, str]] = []
    errors: list[str] = []
    for match in _KEY.finditer(body):
        key = match.group(1).strip()
        value = _VALUE.match(body, match.end())
        if value is None:
            errors.append(f"argument {key!r} has no <arg_value>…</arg_value>")
        else:
            pairs.append((key, value.group(1)))
    return pairs, errors


def _parse_block(body: str, schemas: dict[str, dict[str, Any]] | None) -> FunctionCall:
    first = body.find("<arg_key>")
    name = (body if first < 0 else body[:first]).strip()
    schema = {} if schemas is None else schemas.get(name, {})
    pairs, errors = _pairs(body)
    args = coerce_arguments(pairs, schema, errors, "argument")
    return finish_call(
        name, args, errors, schemas, "tool call needs a function name after <tool_call>"
    )


@ToolParser.register("glm")
class GlmToolParser(ToolParser):
    """Parser for GLM's ``<tool_call>NAME<arg_key>…</arg_key><arg_value>…</arg_value>`` format."""

    # the markers may be special tokens, which streaming decodes away: hold all
    tool_call_start = None
    skip_special_tokens = False
    stop_tokens = ("<|observation|>",)
    markup_tokens = (
        _START, _END, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<think>",
        "</think>",
    )

    def parse_text(
        self, text: str, tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        """The parsing itself, on text decoded with the special tokens."""
        schemas = tool_parameter_schemas(tools)
        content, bodies, unclosed = split_blocks(text, _START, _END)
        calls = [_parse_block(body, schemas) for body in bodies]
        if unclosed is not None:
            calls.append(
                FunctionCall(
                    name="", arguments=unclosed.strip(), error=f"{_START} block is not closed"
                )
            )
        content = _THINKING.sub("", self.without_special_tokens(content))
        return content.strip(), calls
