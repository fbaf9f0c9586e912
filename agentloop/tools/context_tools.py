"""Tools that edit the conversation: ``delete_context``, ``summarize_context``, and the API behind
them.

During a ``tool_agent`` tool turn any tool may read the conversation with :func:`current_messages`
and ask for an edit with :func:`request_context_edit` (a :class:`ContextEdit`); both raise
:class:`RuntimeError` outside a tool turn.  Edits of one turn apply after all its calls returned and
make ``tool_agent`` close the trajectory as a snapshot.  :class:`DeleteContextTool` and
:class:`SummarizeContextTool` are the built-in tools.  Spec (indices, what cannot be edited, the
tools' config): docs/context.md#context-editing-tools.
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from agentloop.tools.base import BaseTool
from agentloop.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from agentloop.utils.imports import import_object

SUMMARY_PREFIX = "Summary of earlier messages: "


@dataclass(frozen=True)
class ContextEdit:
    """Replace messages ``start`` to ``stop - 1`` of the conversation by ``replacement`` (empty:
    delete them).

    Build one with :meth:`delete` or :meth:`summarize`; indices are those of
    :func:`current_messages`.
    """

    start: int
    stop: int
    replacement: tuple[dict[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.start, bool) or isinstance(self.stop, bool) \
                or not isinstance(self.start, int) or not isinstance(self.stop, int):
            raise ValueError(
                f"message indices must be integers, got start={self.start!r}, stop={self.stop!r}"
            )
        if not 0 <= self.start < self.stop:
            raise ValueError(
                f"empty or negative message range [{self.start}, {self.stop}): "
                f"give 0 <= start < stop"
            )

    @classmethod
    def delete(cls, start: int, stop: int) -> ContextEdit:
        """Remove messages ``start`` .. ``stop - 1``."""
        return cls(start, stop)

    @classmethod
    def summarize(cls, start: int, stop: int, summary: str, role: str = "user") -> ContextEdit:
        """Replace messages ``start`` .. ``stop - 1`` by one ``role`` message
        ``SUMMARY_PREFIX + summary``."""
        return cls(start, stop, ({"role": role, "content": SUMMARY_PREFIX + summary},))

    def apply(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with this edit made (a new list)."""
        return [*messages[:self.start], *(dict(m) for m in self.replacement), *messages[self.stop:]]


@dataclass
class ToolTurnContext:
    """The conversation a tool turn sees (up to the calling assistant turn) and the edits its
    tools asked for."""

    messages: list[dict[str, Any]]
    edits: list[ContextEdit] = field(default_factory=list)


_TURN: contextvars.ContextVar[ToolTurnContext | None] = contextvars.ContextVar(
    "agentloop_tool_turn", default=None
)


@contextmanager
def tool_turn(messages: list[dict[str, Any]]) -> Iterator[ToolTurnContext]:
    """Run the tool calls of one turn inside this block: they see ``messages`` and their edits
    are collected."""
    turn = ToolTurnContext(messages=list(messages))
    token = _TURN.set(turn)
    try:
        yield turn
    finally:
        _TURN.reset(token)


def _turn() -> ToolTurnContext:
    turn = _TURN.get()
    if turn is None:
        raise RuntimeError(
            "no conversation here: current_messages() / "
            "request_context_edit() work only inside a "
            "tool call made by tool_agent (or inside "
            "agentloop.tools.context_tools.tool_turn(...))"
        )
    return turn


def current_messages() -> list[dict[str, Any]]:
    """A copy of the conversation the current tool call was made in (last: the calling assistant
    turn)."""
    return [dict(m) for m in _turn().messages]


def _has_images(message: dict[str, Any]) -> bool:
    content = message.get("content")
    return isinstance(content, list) and any(
        isinstance(p, dict) and p.get("type") == "image" for p in content
    )


def request_context_edit(edit: ContextEdit) -> None:
    """Ask ``tool_agent`` to make ``edit`` once this tool turn ends
    (docs/context.md#context-editing-tools).

    Raises:
        ValueError: the range reaches the calling assistant turn, overlaps an edit already asked for
        in this
            turn, or holds a message with images.
    """
    turn = _turn()
    _check_range(turn, edit.start, edit.stop)
    for other in turn.edits:
        if edit.start < other.stop and other.start < edit.stop:
            raise ValueError(
                f"messages {edit.start}-{edit.stop - 1} overlap messages "
                f"{other.start}-"
                f"{other.stop - 1}, already edited in this turn"
            )
    turn.edits.append(edit)


def _check_range(turn: ToolTurnContext, start: int, stop: int) -> None:
    editable = len(turn.messages) - 1  # the calling assistant turn stays
    if stop > editable:
        raise ValueError(
            f"messages {start}-{stop - 1} cannot be edited: only messages "
            f"0-{editable - 1} come "
            f"before this turn (message {editable} is the call itself)"
        )
    if any(_has_images(m) for m in turn.messages[start:stop]):
        raise ValueError(f"messages {start}-{stop - 1} hold images, which cannot be removed")


def _index_range(parameters: dict[str, Any]) -> tuple[int, int]:
    """``(start, stop)`` from the call's inclusive ``first`` / ``last`` (``last`` defaults to
    ``first``)."""
    first, last = parameters.get("first"), parameters.get("last", parameters.get("first"))
    for name, value in (("first", first), ("last", last)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"'{name}' must be a message index (an integer), got {value!r}")
    if last < first:  # type: ignore[operator]
        raise ValueError(f"'last' ({last}) is before 'first' ({first})")
    return first, last + 1  # type: ignore[operator,return-value]


def _range_schema(name: str, description: str, extra: dict[str, Any] | None = None,
                  required: tuple[str, ...] = ("first", "last")) -> OpenAIFunctionToolSchema:
    properties = {
        "first": {
            "type": "integer",
            "description": "Index of the first message (0 = the first message).",
        },
        "last": {"type": "integer", "description": "Index of the last message, included."},
        **(extra or {}),
    }
    return OpenAIFunctionToolSchema.model_validate(
        {
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {
                    "type": "object", "properties": properties, "required": list(required),
                },
            },
        }
    )


class DeleteContextTool(BaseTool):
    """``delete_context(first, last)``: remove messages ``first..last`` from the conversation."""

    def __init__(
        self, config: dict[str, Any] | None = None,
        tool_schema: OpenAIFunctionToolSchema | None = None,
    ):
        super().__init__(
            config or {},
            tool_schema
            or _range_schema(
                "delete_context",
                "Delete earlier messages from the conversation, numbered from 0, to free context.",
            ),
        )

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        start, stop = _index_range(parameters)
        request_context_edit(ContextEdit.delete(start, stop))
        count = stop - start
        return (
            ToolResponse(
                text=f"Deleted messages {start}-{stop - 1} ({count} message{'s' * (count > 1)})."
            ),
            0.0,
            {},
        )


class SummarizeContextTool(BaseTool):
    """``summarize_context(first, last, summary)``: replace messages ``first..last`` by a summary
    message.

    Config: ``summarizer`` (optional ``pkg.module:function``, called with the messages being
    replaced; its string is the summary and the model's ``summary`` argument is ignored),
    ``summary_role`` (default ``user``).
    """

    def __init__(
        self, config: dict[str, Any] | None = None,
        tool_schema: OpenAIFunctionToolSchema | None = None,
    ):
        config = dict(config or {})
        path = config.get("summarizer")
        self.summarizer = (
            import_object(str(path), "summarize_context config.summarizer") if path else None
        )
        if self.summarizer is not None and not callable(self.summarizer):
            raise ValueError(f"summarize_context config.summarizer {path!r} is not callable")
        self.summary_role = str(config.get("summary_role", "user"))
        summary = {
            "summary": {
                "type": "string",
                "description": "What the replaced messages said that still matters.",
            }
        }
        super().__init__(
            config,
            tool_schema
            or _range_schema(
                "summarize_context",
                "Replace earlier messages, numbered from 0, by a short summary to free context.",
                summary,
                ("first", "last") if self.summarizer is not None else ("first", "last", "summary"),
            ),
        )

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        start, stop = _index_range(parameters)
        _check_range(_turn(), start, stop)
        if self.summarizer is not None:
            summary = self.summarizer(current_messages()[start:stop])
            if inspect.isawaitable(summary):
                summary = await summary
        else:
            summary = parameters.get("summary")
        if not isinstance(summary, str) or not summary.strip():
            raise ValueError("'summary' must be a non-empty string")
        request_context_edit(ContextEdit.summarize(start, stop, summary, self.summary_role))
        return ToolResponse(text=f"Replaced messages {start}-{stop - 1} by a summary."), 0.0, {}
