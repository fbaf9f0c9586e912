"""Tool-call parsers: turn the policy's sampled ids into (content, tool calls).

Registry as in verl: ``@ToolParser.register("hermes")`` and ``ToolParser.get_tool_parser(name, tokenizer)``
(also exported as :func:`get_tool_parser`).  Built in: ``hermes``, ``qwen3_coder``, ``llama3_json`` and
``gpt-oss`` (alias ``gpt_oss``), one module each.  ``extract_tool_calls`` never raises on model output: a
malformed call comes back as a :class:`FunctionCall` with ``error`` set (the loop reports it to the
model and records a ``parse_error`` status); arguments are never ``eval``-ed.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, Field

from agentloop.errors import ConfigError


class FunctionCall(BaseModel):
    """One tool call the policy asked for."""

    name: str
    """Function name ("" when it could not be parsed)."""
    arguments: str
    """Arguments as a JSON object string (the raw text when it was not valid JSON)."""
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    """Call id, echoed in the tool message (``tool_call_id``)."""
    error: str | None = None
    """Why the call is malformed; None for a well-formed call."""


def tool_names(tools: list[dict[str, Any]] | None) -> set[str] | None:
    """The names of ``tools`` (OpenAI tool dicts or bare function dicts); None when no tools were given."""
    return None if tools is None else {str((t.get("function") or t).get("name")) for t in tools}


def unknown_tool_error(name: str, allowed: set[str] | dict[str, Any]) -> str:
    """The error a call to a tool that is not offered gets (it names the available tools)."""
    return f"unknown tool {name!r}; available tools: {sorted(allowed)}"


class ToolParser(ABC):
    """Base class; subclasses implement :meth:`parse_text` (on the decoded response)."""

    _registry: ClassVar[dict[str, type[ToolParser]]] = {}
    tool_call_start: ClassVar[str | None] = None
    """Decoded text that opens a tool call; streaming holds content back from it on (None: hold all)."""
    skip_special_tokens: ClassVar[bool] = True
    """How :meth:`extract_tool_calls` decodes (False for formats marked by special tokens, e.g. harmony)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    async def extract_tool_calls(
        self, response_ids: list[int], tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        """Split a response into its text content and its tool calls."""
        text = self.tokenizer.decode(response_ids, skip_special_tokens=self.skip_special_tokens)
        return self.parse_text(text, tools)

    @abstractmethod
    def parse_text(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str, list[FunctionCall]]:
        """The parsing itself, on decoded text."""

    @classmethod
    def register(cls, name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
        """Class decorator registering a parser under ``name`` (the ``multi_turn.format`` value)."""

        def decorator(sub: type[ToolParser]) -> type[ToolParser]:
            cls._registry[name] = sub
            return sub

        return decorator

    @classmethod
    def get_tool_parser(cls, name: str, tokenizer: Any) -> ToolParser:
        """An instance of the parser registered as ``name``."""
        from agentloop.parsers import gpt_oss, hermes, llama3_json, qwen3_coder  # noqa: F401 - register them

        if name not in cls._registry:
            raise ConfigError(
                f"unknown tool parser {name!r} (actor_rollout_ref.rollout.multi_turn.format); "
                f"registered: {sorted(cls._registry)}"
            )
        return cls._registry[name](tokenizer)


def get_tool_parser(name: str, tokenizer: Any) -> ToolParser:
    """Module-level alias of :meth:`ToolParser.get_tool_parser`."""
    return ToolParser.get_tool_parser(name, tokenizer)
