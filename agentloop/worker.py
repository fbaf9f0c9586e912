"""The documented import path of :mod:`agentloop.rollout.worker` (re-exports only)."""

from agentloop.rollout.worker import (  # noqa: F401
    AgentLoopWorker,
    WorkerStats,
    agent_names,
    check_batch,
    error_batch,
    load_rollout_tools,
    trajectory_info,
)

__all__ = [
    "AgentLoopWorker", "WorkerStats", "agent_names", "check_batch", "error_batch",
    "load_rollout_tools", "trajectory_info",
]
