"""The documented import path of :mod:`agentloop.rollout.rollouter` (re-exports only)."""

from agentloop.rollout.rollouter import (  # noqa: F401
    Rollouter,
    engine_capacity,
)

__all__ = [
    "Rollouter",
    "engine_capacity",
]
