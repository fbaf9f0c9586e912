"""ByteDance Seed-OSS tool calls: Qwen3-Coder's elements inside ``<seed:tool_call>`` blocks (verl's
``seed``).

Format::

    <seed:tool_call>
    <function=NAME>
    <parameter=P>VALUE</parameter>
    </function>
    </seed:tool_call>

Everything else follows :mod:`agentloop.parsers.qwen3_coder` (values coerced to the types the tool's
schema declares, JSON else text when untyped; malformed elements give calls with ``error``).  The
block tags may be special tokens, so the ids are decoded with them; other special tokens
(``<seed:eos>``, padding) are dropped from the content.
"""

from __future__ import annotations

from agentloop.parsers.base import ToolParser
from agentloop.parsers.qwen3_coder import Qwen3CoderToolParser


@ToolParser.register("seed")
class SeedToolParser(Qwen3CoderToolParser):
    """Parser for Seed-OSS's ``<seed:tool_call><function=…><parameter=…>`` format."""

    # the block tags may be special tokens, which streaming decodes away: hold all
    tool_call_start = None
    block_start = "<seed:tool_call>"
    block_end = "</seed:tool_call>"
    skip_special_tokens = False
    markup_tokens = ("<seed:tool_call>", "</seed:tool_call>")
