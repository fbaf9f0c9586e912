"""Turning sampled ids into OpenAI output: content, tool calls and ``finish_reason``.

* ``finish_reason`` is exactly one of ``tool_calls`` (the engine stopped and the parser found at least
  one well-formed call), ``stop`` and ``length`` (the token budget or ``max_tokens`` ran out) — never
  merged.  Malformed calls are not turned into ``tool_calls``: their text stays in ``content`` so
  the agent sees what the model wrote.
* Streaming (:class:`StreamDecoder`): content is emitted as it is decoded, holding back an
  incomplete UTF-8 character, leading and trailing whitespace (the non-streaming content is
  stripped), and everything from the parser's tool-call start marker on; at the end the remainder
  is emitted so that the streamed content equals the non-streaming content.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentloop.gateway.protocol import openai_tool_calls
from agentloop.parsers.base import ToolParser
from agentloop.types import StopReason


@dataclass
class DecodedTurn:
    """One assistant turn as returned to the client."""

    message: dict[str, Any]
    """``{"role": "assistant", "content": ..., "tool_calls"?: [...]}``."""
    finish_reason: str
    num_parse_errors: int = 0


async def decode_turn(
    parser: ToolParser | None, tokenizer: Any, token_ids: list[int], stop_reason: StopReason,
    tools: list[dict[str, Any]] | None, parse_tools: bool,
) -> DecodedTurn:
    """Content, tool calls and finish reason of one generation."""
    calls: list[Any] = []
    if parser is not None and parse_tools:
        content, calls = await parser.extract_tool_calls(token_ids, tools)
    else:
        content = tokenizer.decode(token_ids, skip_special_tokens=True).strip()
    good = [c for c in calls if c.error is None]
    bad = [c for c in calls if c.error is not None]
    if bad:  # keep what the model wrote: the raw text (calls included) becomes the content
        content = tokenizer.decode(token_ids, skip_special_tokens=True).strip()
        good = []
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if good:
        message["tool_calls"] = openai_tool_calls(good)
        message["content"] = content or None  # as OpenAI: null content next to tool calls
    if stop_reason == StopReason.LENGTH:
        finish = "length"
    elif good:
        finish = "tool_calls"
    else:
        finish = "stop"
    return DecodedTurn(message=message, finish_reason=finish, num_parse_errors=len(bad))


class StreamDecoder:
    """Incremental content for server-sent events (see the module docstring).

    Args:
        tokenizer: decodes ids (``skip_special_tokens=True``, as the parsers do).
        hold_from: text from which on output is held back (the parser's tool-call start marker).
        hold_all: hold everything until :meth:`finish` (a parser without a known start marker).
    """

    def __init__(self, tokenizer: Any, hold_from: str | None, hold_all: bool = False) -> None:
        self.tokenizer = tokenizer
        self.hold_from = hold_from
        self.hold_all = hold_all
        self.ids: list[int] = []
        self.sent = ""

    def push(self, token_ids: list[int]) -> str:
        """Add sampled ids; returns the content delta that can be sent now ("" if none)."""
        self.ids.extend(token_ids)
        if self.hold_all:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        text = text.rstrip("\ufffd")  # an incomplete UTF-8 character decodes as U+FFFD
        if self.hold_from:
            cut = text.find(self.hold_from)
            text = text[:cut] if cut >= 0 else _without_marker_prefix(text, self.hold_from)
        text = text.strip()
        if not text.startswith(self.sent):
            return ""
        delta = text[len(self.sent):]
        self.sent = text
        return delta

    def finish(self, final_content: str) -> tuple[str, str]:
        """The last delta and the content the client has seen in total (stored in the trajectory)."""
        if final_content.startswith(self.sent):
            delta = final_content[len(self.sent):]
            self.sent = final_content
            return delta, final_content
        return "", self.sent


def _without_marker_prefix(text: str, marker: str) -> str:
    """Drop a tail of ``text`` that could be the start of ``marker`` (not complete yet)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return text[:-k]
    return text
