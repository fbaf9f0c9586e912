"""Tail-aware request priority (config ``actor_rollout_ref.rollout.server.priority``).

A priority policy is a callable ``(request_id, prompt_len) -> int``: the engine priority (lower runs
first) the router sends with each call, which matters only when a server queues.
:class:`ContextPriority` ranks a turn by its prompt length, so the trajectories that have come
furthest go first; :func:`make_priority` builds one from the config value (ConfigError for an
unknown name).  Off by default. Spec and measurements:
docs/routing.md#tail-aware-priority-serverpriority.
"""

from __future__ import annotations

from agentloop.errors import ConfigError

PRIORITY_POLICIES = ("context",)


class ContextPriority:
    """Engine priority ``-(prompt_len // bucket)``: longer contexts first; within a bucket,
    arrival order."""

    def __init__(self, bucket: int = 256) -> None:
        if bucket < 1:
            raise ConfigError(f"ContextPriority: bucket must be >= 1 token, got {bucket}")
        self.bucket = int(bucket)

    def __call__(self, request_id: str, prompt_len: int) -> int:
        return -(int(prompt_len) // self.bucket)


def make_priority(name: str | None) -> ContextPriority | None:
    """The policy named by ``rollout.server.priority`` (null/``fcfs``: none, engine order is
    arrival order)."""
    if name is None or str(name).lower() in ("", "none", "null", "fcfs"):
        return None
    if str(name).lower() == "context":
        return ContextPriority()
    raise ConfigError(
        f"actor_rollout_ref.rollout.server.priority={name!r} is not a priority policy; use "
        f"null (first come, first "
        f"served) or one of {', '.join(PRIORITY_POLICIES)} (docs/routing.md)"
    )
