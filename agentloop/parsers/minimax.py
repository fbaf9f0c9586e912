"""MiniMax tool calls: ``<invoke>`` elements inside ``<minimax:tool_call>`` blocks (verl's
``minimax``).

Format (MiniMax-M1 / M2)::

    <minimax:tool_call>
    <invoke name="NAME">
    <parameter name="P">VALUE</parameter>
    </invoke>
    </minimax:tool_call>

A block may hold several ``<invoke>`` elements (one call each).  Content is the text outside the
blocks (stripped, special tokens other than the block tags dropped).  Values are coerced as in
:mod:`agentloop.parsers.qwen3_coder`: to the type the tool's schema declares, else JSON when the
text parses, else the text.  A block without ``<invoke``, an element or block left unclosed, a
repeated parameter, a value that does not fit its type, or a tool not in ``tools`` gives a call with
``error``.
"""

from __future__ import annotations

import re
from typing import Any

from agentloop.parsers.base import FunctionCall, ToolParser, finish_call, split_blocks
from agentloop.parsers.qwen3_coder import coerce_arguments, tool_parameter_schemas

_START, _END = "<minimax:tool_call>", "</minimax:tool_call>"
_INVOKE = re.compile(r'<invoke\s+name="([^"]*)"\s*>(.*?)(</invoke>|$)', re.DOTALL)
_PARAMETER = re.compile(r'<parameter\s+name="([^"]*)"\s*>(.*?)</parameter>', re.DOTALL)


def _parse_invoke(
    name: str, body: str, closed: bool, schemas: dict[str, dict[str, Any]] | None
) -> FunctionCall:
    name = name.strip()
    schema = {} if schemas is None else schemas.get(name, {})
    errors = [] if closed else [f'<invoke name="{name}"> is not closed with </invoke>']
    pairs = [(param.strip(), raw) for param, raw in _PARAMETER.findall(body)]
    args = coerce_arguments(pairs, schema, errors)
    return finish_call(name, args, errors, schemas)


@ToolParser.register("minimax")
class MiniMaxToolParser(ToolParser):
    """Parser for MiniMax's ``<minimax:tool_call><invoke name=…><parameter name=…>`` format."""

    # the markers may be special tokens, which streaming decodes away: hold all
    tool_call_start = None
    skip_special_tokens = False
    markup_tokens = (_START, _END)

    def parse_text(
        self, text: str, tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        """The parsing itself, on text decoded with the special tokens."""
        schemas = tool_parameter_schemas(tools)
        content, bodies, unclosed = split_blocks(text, _START, _END)
        calls: list[FunctionCall] = []
        blocks = [(body, True) for body in bodies] + (
            [(unclosed, False)] if unclosed is not None else []
        )
        for body, closed in blocks:
            invokes = _INVOKE.findall(body)
            found = [_parse_invoke(name, inner, bool(end), schemas) for name, inner, end in invokes]
            found = found or [
                FunctionCall(
                    name="", arguments=body.strip(), error=f"{_START} block has no <invoke>"
                )
            ]
            for call in found if not closed else ():
                call.error = "; ".join(
                    e for e in (f"{_START} block is not closed", call.error) if e
                )
            calls += found
        return self.without_special_tokens(content).strip(), calls
