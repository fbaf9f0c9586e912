"""Turning sampled ids into OpenAI output: reasoning, content, tool calls and ``finish_reason``.

* ``finish_reason`` is exactly one of ``tool_calls`` (the engine stopped and the parser found at
  least one well-formed call), ``stop`` and ``length`` (the token budget or ``max_tokens`` ran
  out) — never merged.  Malformed calls are not turned into ``tool_calls``: their text stays in
  ``content`` so the agent sees what the model wrote.
* Reasoning (a :class:`~agentloop.parsers.reasoning.ReasoningParser`,
  ``gateway.reasoning_parser``): the thinking section becomes ``reasoning_content`` (stripped;
  left out when empty); only the text after it is content and parsed for tool calls.  Without a
  reasoning parser nothing changes.
* Streaming (:class:`StreamDecoder`): reasoning, then content, are emitted as they are decoded,
  holding back an incomplete UTF-8 character, leading and trailing whitespace (the non-streaming
  fields are stripped), a tail that could begin the reasoning end marker, and everything from the
  parser's tool-call start marker on; :meth:`StreamDecoder.settle` emits the rest so that the
  streamed reasoning and content equal the non-streaming ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentloop.gateway.protocol import openai_tool_calls
from agentloop.gateway.turn import ReasoningDelta, TextDelta
from agentloop.parsers.base import ToolParser, as_tool_dicts
from agentloop.parsers.reasoning import ReasoningParser, without_marker_prefix
from agentloop.types import StopReason

StreamDelta = TextDelta | ReasoningDelta


@dataclass
class DecodedTurn:
    """One assistant turn as returned to the client."""

    message: dict[str, Any]
    """``{"role": "assistant", "content", "tool_calls"?: [...], "reasoning_content"?: str}``."""
    finish_reason: str
    num_parse_errors: int = 0


async def decode_turn(
    parser: ToolParser | None, tokenizer: Any, token_ids: list[int], stop_reason: StopReason,
    tools: list[dict[str, Any]] | None, parse_tools: bool, reasoning: ReasoningParser | None = None,
) -> DecodedTurn:
    """Reasoning, content, tool calls and finish reason of one generation.

    Args:
        parser: the tool-call parser (None: no tool calls).
        tokenizer: decodes ``token_ids``.
        token_ids: the sampled ids.
        stop_reason: why the engine stopped (``length`` gives ``finish_reason`` length).
        tools: the request's tools (a parser refuses calls to others).
        parse_tools: parse tool calls at all (False for ``tool_choice: none``).
        reasoning: the reasoning parser (None: the whole response is the answer).
    Returns:
        the message, finish reason and the number of malformed calls.
    """
    thought: str | None = None
    calls: list[Any] = []
    if reasoning is not None:
        thought, content, calls = await _answer_after_reasoning(parser, tokenizer, token_ids, tools,
                                                               parse_tools, reasoning)
    elif parser is not None and parse_tools:
        content, calls = await parser.extract_tool_calls(token_ids, tools)
    else:
        content = tokenizer.decode(token_ids, skip_special_tokens=True).strip()
    good = [c for c in calls if c.error is None]
    bad = [c for c in calls if c.error is not None]
    if bad:  # keep what the model wrote: the raw answer text (calls included) becomes the content
        content = _raw_answer(tokenizer, token_ids, reasoning)
        good = []
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if good:
        message["tool_calls"] = openai_tool_calls(good)
        message["content"] = content or None  # as OpenAI: null content next to tool calls
    if thought:
        message["reasoning_content"] = thought
    if stop_reason == StopReason.LENGTH:
        finish = "length"
    elif good:
        finish = "tool_calls"
    else:
        finish = "stop"
    return DecodedTurn(message=message, finish_reason=finish, num_parse_errors=len(bad))


async def _answer_after_reasoning(
    parser: ToolParser | None, tokenizer: Any, token_ids: list[int],
    tools: list[dict[str, Any]] | None, parse_tools: bool, reasoning: ReasoningParser,
) -> tuple[str | None, str, list[Any]]:
    """(stripped reasoning or None, content, calls) of a response that may open with thinking."""
    part = reasoning.split(tokenizer.decode(token_ids, skip_special_tokens=True))
    thought = None if part.reasoning is None else part.reasoning.strip()
    answer = (part.content or "").strip()
    if parser is None or not parse_tools:
        return thought, answer, []
    if part.reasoning is None:
        content, calls = await parser.extract_tool_calls(token_ids, tools)
        return thought, content, calls
    if type(parser).parse_text is not ToolParser.parse_text:  # a text parser: give it the answer
        raw = tokenizer.decode(token_ids, skip_special_tokens=parser.skip_special_tokens)
        content, calls = parser.parse_text(reasoning.split(raw).content or "", as_tool_dicts(tools))
        return thought, content, calls
    answer_ids = _ids_after(tokenizer, token_ids, reasoning.end)  # a parser of ids (verl style)
    content, calls = await parser.extract_tool_calls(answer_ids, tools)
    return thought, content, calls


def _raw_answer(tokenizer: Any, token_ids: list[int], reasoning: ReasoningParser | None) -> str:
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    if reasoning is None:
        return text.strip()
    return (reasoning.split(text).content or "").strip()


def _ids_after(tokenizer: Any, token_ids: list[int], marker: str) -> list[int]:
    """The ids after the shortest prefix whose text holds ``marker`` (all when none does)."""
    lo, hi = 0, len(token_ids)
    if marker not in tokenizer.decode(token_ids, skip_special_tokens=True):
        return list(token_ids)
    while lo < hi:  # the smallest k with the marker in decode(ids[:k]); containment grows with k
        mid = (lo + hi) // 2
        if marker in tokenizer.decode(token_ids[:mid], skip_special_tokens=True):
            hi = mid
        else:
            lo = mid + 1
    return list(token_ids[lo:])


class StreamDecoder:
    """Incremental reasoning and content for server-sent events (see the module docstring).

    Args:
        tokenizer: decodes ids (``skip_special_tokens=True``, as the parsers do).
        hold_from: text from which on content is held back (the parser's tool-call start marker).
        hold_all: hold all content until the end (a parser without a known start marker).
        reasoning: the reasoning parser (None: every delta is content).
    """

    def __init__(self, tokenizer: Any, hold_from: str | None, hold_all: bool = False,
                 reasoning: ReasoningParser | None = None) -> None:
        self.tokenizer = tokenizer
        self.hold_from = hold_from
        self.hold_all = hold_all
        self.reasoning = reasoning
        self.ids: list[int] = []
        self.sent = ""
        self.sent_reasoning = ""

    def push(self, token_ids: list[int]) -> str:
        """Add sampled ids; returns the content delta that can be sent now ("" if none).

        With a reasoning parser, reasoning deltas are dropped here: use :meth:`push_deltas`.
        """
        return "".join(d.text for d in self.push_deltas(token_ids) if isinstance(d, TextDelta))

    def push_deltas(self, token_ids: list[int]) -> list[StreamDelta]:
        """Add sampled ids; returns what can be sent now: a reasoning, then a content delta."""
        self.ids.extend(token_ids)
        if self.hold_all and self.reasoning is None:
            return []
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        text = text.rstrip("\ufffd")  # an incomplete UTF-8 character decodes as U+FFFD
        out: list[StreamDelta] = []
        if self.reasoning is not None:
            part = self.reasoning.split(text, partial=True)
            if part.reasoning is not None:
                delta = self._advance_reasoning(part.reasoning.strip())
                out += [ReasoningDelta(delta)] if delta else []
            if part.content is None:
                return out
            text = part.content
        if not self.hold_all:
            delta = self._advance_content(text)
            out += [TextDelta(delta)] if delta else []
        return out

    def _advance_reasoning(self, visible: str) -> str:
        if not visible.startswith(self.sent_reasoning):
            return ""
        delta = visible[len(self.sent_reasoning):]
        self.sent_reasoning = visible
        return delta

    def _advance_content(self, text: str) -> str:
        if self.hold_from:
            cut = text.find(self.hold_from)
            text = text[:cut] if cut >= 0 else without_marker_prefix(text, self.hold_from)
        text = text.strip()
        if not text.startswith(self.sent):
            return ""
        delta = text[len(self.sent):]
        self.sent = text
        return delta

    def finish(self, final_content: str) -> tuple[str, str]:
        """The last content delta and the content the client has seen in total (what is stored)."""
        if final_content.startswith(self.sent):
            delta = final_content[len(self.sent):]
            self.sent = final_content
            return delta, final_content
        return "", self.sent

    def settle(self, message: dict[str, Any]) -> list[StreamDelta]:
        """The last deltas; sets ``message`` (from :func:`decode_turn`) to what the client saw.

        ``message["reasoning_content"]`` and ``message["content"]`` become the streamed totals
        (content None next to tool calls when empty, as non-streaming), so the stored turn is what
        the client received.  Returns the reasoning tail, then the content tail (non-empty ones).
        """
        out: list[StreamDelta] = []
        final = message.get("reasoning_content") or ""
        if final.startswith(self.sent_reasoning):
            tail, self.sent_reasoning = final[len(self.sent_reasoning):], final
            out += [ReasoningDelta(tail)] if tail else []
        if self.sent_reasoning:
            message["reasoning_content"] = self.sent_reasoning
        else:
            message.pop("reasoning_content", None)
        tail, seen = self.finish(message.get("content") or "")
        out += [TextDelta(tail)] if tail else []
        message["content"] = seen or (None if message.get("tool_calls") else "")
        return out
