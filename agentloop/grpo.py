"""The documented import path of :mod:`agentloop.batch.grpo` (re-exports only)."""

from agentloop.batch.grpo import (  # noqa: F401
    EPISODE_WEIGHTS,
    GroupedAdvantages,
    group_advantages,
)

__all__ = [
    "EPISODE_WEIGHTS", "GroupedAdvantages", "group_advantages",
]
