"""The documented import path of :mod:`agentloop.rollout.manager` (re-exports only)."""

from agentloop.rollout.manager import (  # noqa: F401
    AgentLoopManager,
)

__all__ = [
    "AgentLoopManager",
]
