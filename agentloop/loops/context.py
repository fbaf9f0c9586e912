"""Context edits inside ``tool_agent``: when the next context is not an extension of the tokens so
far.

When the conversation the model is to see next is not the conversation so far plus new turns (source
``tool``: a context-editing tool; ``window``: ``multi_turn.context_window`` slid; ``template``: the
chat template is not prefix-stable), ``tool_agent`` closes the current trajectory as a snapshot and
starts a new one from a full render of the edited conversation.  This module holds the pieces:
:class:`ContextSettings` (the two config keys, checked), :func:`slide_window`,
:func:`edited_history` and :class:`Snapshots`.  Spec (sources, what each trajectory holds, caps,
counters): docs/context.md#context-edits-snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentloop.config.schema import MultiTurnConfig
from agentloop.tools.context_tools import ContextEdit
from agentloop.types import AgentLoopOutput, MultiTrajectoryAgentLoopOutput

PLACEHOLDER = "[older tool result removed from the context]"
"""What a tool result outside ``multi_turn.context_window`` is replaced by."""

TOOL, WINDOW, TEMPLATE = "tool", "window", "template"


@dataclass(frozen=True)
class ContextSettings:
    """``multi_turn.context_window`` and ``multi_turn.max_context_edits``, checked."""

    window: int | None = None
    max_edits: int | None = None

    @classmethod
    def from_config(cls, multi_turn: MultiTurnConfig | Any) -> ContextSettings:
        """The two keys of ``multi_turn``: a :class:`MultiTurnConfig`, or the ``multi_turn`` mapping
        (absent keys take the YAML's values).

        Raises:
            ConfigError: a value is wrong (the message says what to give).
        """
        if not isinstance(multi_turn, MultiTurnConfig):
            multi_turn = MultiTurnConfig.from_rollout({"multi_turn": multi_turn})
        return cls(window=multi_turn.context_window, max_edits=multi_turn.max_context_edits)


def _text_of(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return content or ""


def _with_placeholder(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, list):  # keep the image parts: the trajectory's image list stays aligned
        parts = [p for p in content if not (isinstance(p, dict) and p.get("type") == "text")]
        return {**message, "content": [*parts, {"type": "text", "text": PLACEHOLDER}]}
    return {**message, "content": PLACEHOLDER}


def slide_window(messages: list[dict[str, Any]], window: int) -> list[dict[str, Any]] | None:
    """``messages`` with the tool results of turns older than the last ``window`` turns replaced by
    :data:`PLACEHOLDER`; None when that changes nothing."""
    first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), len(messages))
    starts = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and i > first_user]
    if len(starts) <= window:
        return None
    out, changed = list(messages), False
    for i in range(starts[0], starts[-window]):
        if out[i].get("role") == "tool" and _text_of(out[i]) != PLACEHOLDER:
            out[i], changed = _with_placeholder(out[i]), True
    return out if changed else None


def edited_history(
    history: list[dict[str, Any]], new: list[dict[str, Any]], edits: list[ContextEdit],
    window: int | None,
) -> tuple[list[dict[str, Any]] | None, str | None]:
    """The conversation before ``new`` after the tools' ``edits`` (applied last-first, so every
    index is the one the tool saw) and the window, and the source of the change; ``(None, None)``
    when nothing changes."""
    edited, source = history, None
    if edits:
        for edit in sorted(edits, key=lambda e: e.start, reverse=True):
            edited = edit.apply(edited)
        source = TOOL
    if window is not None:
        slid = slide_window(edited + new, window)
        if slid is not None:
            edited, source = slid[:len(slid) - len(new)], source or WINDOW
    return (edited, source) if source else (None, None)


@dataclass
class Snapshots:
    """The trajectories an episode closed so far, and why each was closed."""

    closed: list[AgentLoopOutput] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    capped: bool = False
    """An edit beyond ``max_context_edits`` ended the episode."""

    def allows_another(self, settings: ContextSettings) -> bool:
        """False when one more snapshot would exceed ``max_context_edits``."""
        return settings.max_edits is None or len(self.closed) < settings.max_edits

    def close(self, trajectory: AgentLoopOutput, source: str) -> None:
        """Keep ``trajectory`` as a closed snapshot, ended by an edit from ``source``."""
        self.closed.append(trajectory)
        self.sources.append(source)

    def finish(self, final: AgentLoopOutput) -> AgentLoopOutput | MultiTrajectoryAgentLoopOutput:
        """The episode: ``final`` alone, or every trajectory in order (final last).  Every row gets
        ``num_context_edits`` (snapshots of the episode), ``context_edit`` (the source that closed
        it; None on the final one) and ``context_edits_capped``."""
        rows = [*self.closed, final]
        for row, source in zip(rows, [*self.sources, None], strict=True):
            row.extra_fields = {
                **row.extra_fields, "num_context_edits": len(self.closed), "context_edit": source,
                "context_edits_capped": self.capped,
            }
        return final if not self.closed else MultiTrajectoryAgentLoopOutput(trajectories=rows)
