"""DeepSeek-V4 tool calls in DSML (verl's ``deepseek_v4``).

Format (``｜`` is the full-width bar U+FF5C)::

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

``string="true"`` marks a value taken verbatim, ``string="false"`` a JSON value.  Content is the
text outside the block after the reasoning: a thinking-mode completion opens with reasoning closed
by ``</think>``, so only the text after the last ``</think>`` is parsed (a chat-mode completion has
none).  Special tokens (``<｜end▁of▁sentence｜>`` always, the tokenizer's others) are
dropped and the content is stripped. A ``string="false"`` value that is not JSON (kept as text), a
block without ``invoke``, an unclosed block or invoke, a repeated parameter or a tool not in
``tools`` gives a call with ``error``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from agentloop.parsers.base import FunctionCall, ToolParser, finish_call, split_blocks, tool_names

DSML = "｜DSML｜"
BLOCK_START, BLOCK_END = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
THINK_END = "</think>"
EOS = "<｜end▁of▁sentence｜>"
_INVOKE = re.compile(rf'<{DSML}invoke name="(.*?)">(.*?)(</{DSML}invoke>|$)', re.DOTALL)
_PARAMETER = re.compile(
    rf'<{DSML}parameter name="(.*?)" ' rf'string="(true|false)">(.*?)</{DSML}parameter>', re.DOTALL
)


def _parse_invoke(name: str, body: str, closed: bool, allowed: set[str] | None) -> FunctionCall:
    args: dict[str, Any] = {}
    errors = [] if closed else [f'invoke {name!r} is not closed with </{DSML}invoke>']
    for param, is_string, raw in _PARAMETER.findall(body):
        if param in args:
            errors.append(f"parameter {param!r} is given twice")
            continue
        if is_string == "true":
            args[param] = raw
            continue
        try:
            args[param] = json.loads(raw)
        except json.JSONDecodeError:
            args[param] = raw
            errors.append(f'parameter {param!r} is marked string="false" but is not valid JSON')
    return finish_call(name, args, errors, allowed)


@ToolParser.register("deepseek_v4")
class DeepSeekV4ToolParser(ToolParser):
    """Parser for DeepSeek-V4's DSML ``tool_calls`` blocks."""

    # the markers may be special tokens, which streaming decodes away: hold all
    tool_call_start = None
    skip_special_tokens = False
    markup_tokens = (BLOCK_START, BLOCK_END, THINK_END)

    def parse_text(
        self, text: str, tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        """The parsing itself, on text decoded with the special tokens."""
        allowed = tool_names(tools)
        answer = text.rpartition(THINK_END)[2]  # reasoning is neither content nor calls
        content, bodies, unclosed = split_blocks(answer, BLOCK_START, BLOCK_END)
        calls: list[FunctionCall] = []
        blocks = [(body, True) for body in bodies] + (
            [(unclosed, False)] if unclosed is not None else []
        )
        for body, closed in blocks:
            found = [
                _parse_invoke(name, inner, bool(end), allowed)
                for name, inner, end in _INVOKE.findall(body)
            ]
            found = found or [
                FunctionCall(name="", arguments=body.strip(), error=f"{BLOCK_START} has no invoke")
            ]
            for call in found if not closed else ():
                call.error = "; ".join(
                    e for e in (f"{BLOCK_START} block is not closed", call.error) if e
                )
            calls += found
        return self.without_special_tokens(content).replace(EOS, "").strip(), calls
