"""Tail-aware request priority (config ``actor_rollout_ref.rollout.server.priority``).

A priority policy maps a generate call to the engine priority vLLM's ``scheduling_policy: priority`` orders its
waiting requests by (lowest value first, ties in arrival order).  It only matters when a server has more
requests than it runs at once (``max_num_seqs``): then, instead of first come first served, the turns of the
trajectories that are furthest along run first.

:class:`ContextPriority` ranks a turn by its prompt length — a trajectory's context grows with every turn and
tool result, and with heavy-tailed workloads a trajectory that has come far is the one most likely to go on
longest (and, in the Rollouter with a staleness bound, the one whose tokens are closest to being thrown away).
The router computes it from the ``prompt_ids`` it already has; nothing else is tracked.

What it buys, in the rollout simulator (``python scripts/sim_rollout.py``; docs/routing.md): nothing in a
synchronous batch (the batch rarely queues; the tail is decode speed, not waiting), and in the Rollouter regime
with ``max_staleness: 1`` fewer trajectories go stale (less work thrown away).  Off by default.
"""

from __future__ import annotations

from agentloop.errors import ConfigError

PRIORITY_POLICIES = ("context",)


class ContextPriority:
    """Engine priority ``-(prompt_len // bucket)``: longer contexts first; within a bucket, arrival order."""

    def __init__(self, bucket: int = 256) -> None:
        if bucket < 1:
            raise ConfigError(f"ContextPriority: bucket must be >= 1 token, got {bucket}")
        self.bucket = int(bucket)

    def __call__(self, request_id: str, prompt_len: int) -> int:
        return -(int(prompt_len) // self.bucket)


def make_priority(name: str | None) -> ContextPriority | None:
    """The policy named by ``rollout.server.priority`` (null/``fcfs``: none, engine order is arrival order)."""
    if name is None or str(name).lower() in ("", "none", "null", "fcfs"):
        return None
    if str(name).lower() == "context":
        return ContextPriority()
    raise ConfigError(
        f"actor_rollout_ref.rollout.server.priority={name!r} is not a priority policy; use null (first come, first "
        f"served) or one of {', '.join(PRIORITY_POLICIES)} (docs/routing.md)"
    )
