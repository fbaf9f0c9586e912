"""Reasoning parsers: split a reasoning model's response into its thinking section and its answer.

Registry as for tool parsers: ``@ReasoningParser.register("name")`` and
``get_reasoning_parser(name, tokenizer)`` (``name`` may also be an import path; an unknown one
raises :class:`~agentloop.errors.ConfigError`).  Chosen by
``actor_rollout_ref.rollout.gateway.reasoning_parser`` (vLLM's ``--reasoning-parser`` names).
Built-ins, for ``<think>…</think>`` templates:

* ``deepseek_r1``: the template's generation prompt opens the thinking section (DeepSeek-R1,
  Qwen3 thinking-2507, QwQ): everything up to ``</think>`` is reasoning (a leading ``<think>``
  the model writes anyway is dropped); a response without ``</think>`` is all reasoning.
* ``qwen3``: the model opens it: a response that starts with ``<think>`` has reasoning up to
  ``</think>`` (all of it when never closed); any other response is all answer.

Spec: docs/gateway.md#reasoning.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from agentloop.utils.registry import Registry


@dataclass(frozen=True)
class ReasoningSplit:
    """A response cut in two.

    ``reasoning`` is None when the response has no thinking section; ``content`` is None while a
    partial response is still inside it (or, with both None, before that is known).
    """

    reasoning: str | None
    content: str | None


class ReasoningParser:
    """Base class: a thinking section from :attr:`start` to :attr:`end` opening a response.

    Subclasses set the markers and :attr:`opened_by_prompt`, or override :meth:`split`.
    """

    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    opened_by_prompt: ClassVar[bool] = False
    """The generation prompt ends with :attr:`start`: the output begins inside the section."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def split(self, text: str, partial: bool = False) -> ReasoningSplit:
        """Split decoded response ``text`` (raw: not stripped).

        Args:
            text: the response decoded so far (``skip_special_tokens=True``).
            partial: more text may follow (streaming): a tail that could begin :attr:`end` is
                held back from the reasoning, and the answer is None until :attr:`end` is seen.
        Returns:
            the reasoning (None: no thinking section) and the answer text after :attr:`end`.
        """
        head = text.lstrip()
        if head.startswith(self.start):
            body = head[len(self.start):]
        elif partial and self.start.startswith(head):
            return ReasoningSplit(None, None)  # could still become the opening marker
        elif self.opened_by_prompt:
            body = text
        else:
            return ReasoningSplit(None, text)
        cut = body.find(self.end)
        if cut >= 0:
            return ReasoningSplit(body[:cut], body[cut + len(self.end):])
        if partial:
            return ReasoningSplit(without_marker_prefix(body, self.end), None)
        return ReasoningSplit(body, "")

    @classmethod
    def register(cls, name: str) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
        """Class decorator registering a parser as ``name`` (a ``gateway.reasoning_parser`` value).

        Raises:
            ConfigError: not a ReasoningParser subclass, or ``name`` is taken by another parser.
        """
        return REASONING_PARSERS.register(name)


def without_marker_prefix(text: str, marker: str) -> str:
    """``text`` without a tail that could be the start of ``marker`` (not complete yet)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return text[:-k]
    return text


REASONING_PARSERS = Registry(
    "reasoning parser", decorator="ReasoningParser.register", base=ReasoningParser,
    where="actor_rollout_ref.rollout.gateway.reasoning_parser",
    how="Register one with @ReasoningParser.register(name), or give the import path of a "
        "ReasoningParser subclass.",
)
"""Reasoning parsers by ``gateway.reasoning_parser`` name."""


@ReasoningParser.register("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    """``<think>`` opened by the generation prompt; reasoning until ``</think>``."""

    opened_by_prompt = True


@ReasoningParser.register("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    """``<think>`` written by the model; a response not starting with it is all answer."""

    opened_by_prompt = False


def get_reasoning_parser(name: str | None, tokenizer: Any = None) -> ReasoningParser | None:
    """An instance of the parser registered as ``name`` (or at that import path); None for None.

    Raises:
        ConfigError: unknown name (with the registered names) or a path that is not a
            ReasoningParser.
    """
    if not name:
        return None
    return REASONING_PARSERS.resolve(str(name))(tokenizer)
