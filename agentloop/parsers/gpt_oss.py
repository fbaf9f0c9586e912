"""gpt-oss tool calls in OpenAI's harmony format (messages delimited by special tokens).

:class:`GptOssToolParser` (``gpt-oss``, alias ``gpt_oss``) decodes with special tokens kept and
returns the ``final`` (else preamble) text as content and each ``to=functions.NAME`` message as a
call (its body a JSON object); ``analysis`` text is kept in :attr:`GptOssToolParser.last_reasoning`.
A malformed call gets ``error``; nothing raises.  ``stop_token_ids`` holds ``<|call|>``.  Spec:
docs/tools.md#gpt-oss-harmony.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from agentloop.parsers.base import FunctionCall, ToolParser, tool_names, unknown_tool_error

_CLOSE = re.compile(r"<\|(?:end|call|return|endoftext)\|>")
_MARKER = re.compile(r"<\|[a-z_]+\|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"(?:^|\s|>)to=([^\s<]+)")
_FUNCTIONS = "functions."


@dataclass
class HarmonyMessage:
    """One message of a sampled response."""

    channel: str | None
    recipient: str | None
    body: str


def split_messages(text: str) -> list[HarmonyMessage]:
    """The messages in decoded harmony text (pieces without ``<|message|>`` are dropped)."""
    messages = []
    for piece in _CLOSE.split(text):
        header, sep, body = piece.partition("<|message|>")
        if not sep:
            continue
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        messages.append(HarmonyMessage(
            channel=channel.group(1) if channel else None,
            recipient=recipient.group(1) if recipient else None, body=body,
        ))
    return messages


def _to_call(message: HarmonyMessage, allowed: set[str] | None) -> FunctionCall:
    recipient, body = message.recipient or "", message.body.strip()
    if not recipient.startswith(_FUNCTIONS) or recipient == _FUNCTIONS:
        error = f"unsupported recipient {recipient!r}; tools are called as to=functions.NAME"
        return FunctionCall(name=recipient, arguments=body, error=error)
    name = recipient[len(_FUNCTIONS):]
    try:
        args = json.loads(body)
    except json.JSONDecodeError as e:
        return FunctionCall(
            name=name, arguments=body, error=f"tool call arguments are not valid JSON: {e.msg}"
        )
    if not isinstance(args, dict):
        return FunctionCall(
            name=name, arguments=body, error="tool call arguments must be a JSON object"
        )
    call = FunctionCall(name=name, arguments=json.dumps(args, ensure_ascii=False))
    if allowed is not None and name not in allowed:
        call.error = unknown_tool_error(name, allowed)
    return call


@ToolParser.register("gpt_oss")
@ToolParser.register("gpt-oss")
class GptOssToolParser(ToolParser):
    """Parser for gpt-oss's harmony messages (``to=functions.NAME`` calls, ``final`` content)."""

    # calls are marked by special tokens, which streaming decodes away: hold all
    tool_call_start = None
    last_reasoning: str = ""
    """The ``analysis`` text of the latest :meth:`parse_text` (messages joined by a newline)."""

    skip_special_tokens = False
    # gpt-oss ends every tool call with it (its generation config stops there too)
    stop_tokens = ("<|call|>",)

    def parse_text(
        self, text: str, tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        """The parsing itself, on text decoded with the special tokens."""
        allowed = tool_names(tools)
        messages = split_messages(text)
        calls = [_to_call(m, allowed) for m in messages if m.recipient]
        final = [m.body for m in messages if not m.recipient and m.channel == "final"]
        other = [m.body for m in messages if not m.recipient and m.channel in (None, "commentary")]
        self.last_reasoning = "\n".join(
            m.body for m in messages if not m.recipient and m.channel == "analysis"
        )
        if not messages:
            return _MARKER.sub("", text).strip(), calls
        return "\n".join(final or other).strip(), calls
