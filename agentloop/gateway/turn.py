"""The gateway's canonical turn, shared by every wire format (dialect).

A dialect (chat completions, OpenAI Responses, Anthropic Messages) translates its request into one
:class:`TurnRequest` (chat-shaped canonical messages and tools), the service serves it against the
session's trie, and the dialect renders the :class:`TurnResult` (or, when streaming, the
:data:`TurnEvent` sequence) back in its own shape.  Spec: docs/gateway.md#dialects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

ToolChoice = Literal["auto", "none", "required"] | dict[str, Any]
"""``auto`` / ``none`` / ``required`` or ``{"type": "function", "name": <tool name>}`` (one named
tool)."""


@dataclass
class TurnRequest:
    """A checked request in canonical form.

    ``messages`` are chat-completions messages: ``role`` (system / developer / user / assistant /
    tool), ``content`` (a string, or a list of ``{"type": "text"}`` / ``{"type": "image_url"}``
    parts), ``tool_calls`` on assistant messages
    (``{"id", "type": "function", "function": {"name", "arguments"}}``, arguments parsed from JSON
    when they are JSON), ``tool_call_id`` on tool messages and ``reasoning_content`` on assistant
    messages that carried reasoning.  ``tools`` are chat-completions function tools.  ``sampling``
    holds only engine keys (temperature, top_p, top_k, seed, max_tokens, stop).
    """

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    sampling: dict[str, Any]
    stream: bool = False
    include_usage: bool = False
    want_logprobs: bool = False
    tool_choice: ToolChoice = "auto"
    response_format: dict[str, Any] | None = None
    """``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?}}`` or
    ``{"type": "json_object"}``."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Dialect-specific values the dialect needs back when it renders (never read by the
    service)."""

    @property
    def parse_tools(self) -> bool:
        """Whether tool calls are parsed out of the output (not with ``tool_choice: none``)."""
        return self.tool_choice != "none"


@dataclass
class TurnResult:
    """One served assistant turn.

    ``message`` is ``{"role": "assistant", "content": str | None, "tool_calls"?: [...],
    "reasoning_content"?: str}`` with tool-call arguments as the JSON strings the model wrote;
    ``finish_reason`` is exactly ``stop``, ``length`` or ``tool_calls``; ``stop_sequence`` is the
    request's stop string that ended it (None when it ended on an end-of-turn token, a tool call or
    the budget).
    """

    message: dict[str, Any]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: str | None = None
    logprobs: dict[str, Any] | None = None
    """Chat-completions ``logprobs`` (``{"content": [...]}``) when the request asked for them."""
    constrained: bool = False
    """The engine sampled under a grammar (tool_choice required / named, response_format)."""


@dataclass
class TextDelta:
    """Streaming: more answer text the client may show now."""

    text: str


@dataclass
class ReasoningDelta:
    """Streaming: more reasoning (thinking) text."""

    text: str


TurnEvent = TextDelta | ReasoningDelta | TurnResult
"""A streamed turn is zero or more deltas then exactly one :class:`TurnResult` (the deltas
concatenated equal the result's content / reasoning); a failure after the stream began is raised as
:class:`~agentloop.gateway.protocol.GatewayHTTPError` from the iterator instead of the result."""
