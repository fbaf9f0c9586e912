"""Mirror of ``verl.experimental.agent_loop`` (and its ``agent_loop`` module) for ported loops.

``agentloop port`` rewrites ``from verl.experimental.agent_loop[.agent_loop] import X`` to import
from here. Every verl name a custom loop uses is re-exported from where it lives in agentloop; the
built-in loops (``SingleTurnAgentLoop``, ``ToolAgentLoop`` and the latter's ``AgentData`` /
``AgentState``) are imported on first access, so this module never takes part in an import cycle.
Any other verl name raises a :class:`~agentloop.compat.import_map.MissingVerlNameError` (an
ImportError) that names it and points at the porting docs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import numpy as np

from agentloop.compat.import_map import MissingVerlNameError, missing_verl_name
from agentloop.compat.wrappers import DictConfigWrap, ToolListWrap
from agentloop.loops.base import AgentLoopBase, register
from agentloop.rollout.manager import AgentLoopManager
from agentloop.rollout.worker import AgentLoopWorker, trajectory_info
from agentloop.routing import AsyncLLMServerManager
from agentloop.types import AgentLoopMetrics, AgentLoopOutput

if TYPE_CHECKING:  # resolved lazily by __getattr__ below
    from agentloop.loops.single_turn import SingleTurnAgentLoop
    from agentloop.loops.tool_agent import AgentData, AgentState, ToolAgentLoop
    from agentloop.types import MultiTrajectoryAgentLoopOutput

__all__ = [
    "AgentData", "AgentLoopBase", "AgentLoopManager", "AgentLoopMetrics", "AgentLoopOutput",
    "AgentLoopWorker", "AgentState", "AsyncLLMServerManager", "MultiTrajectoryAgentLoopOutput",
    "DictConfigWrap", "SingleTurnAgentLoop", "ToolAgentLoop", "ToolListWrap", "get_trajectory_info",
    "register",
]

_LAZY: dict[str, tuple[str, str]] = {
    "SingleTurnAgentLoop": ("agentloop.loops.single_turn", "SingleTurnAgentLoop"),
    "ToolAgentLoop": ("agentloop.loops.tool_agent", "ToolAgentLoop"),
    "AgentData": ("agentloop.loops.tool_agent", "AgentData"),
    "AgentState": ("agentloop.loops.tool_agent", "AgentState"),
    "_agent_loop_registry": ("agentloop.loops.base", "_agent_loop_registry"),
    "MultiTrajectoryAgentLoopOutput": ("agentloop.types", "MultiTrajectoryAgentLoopOutput"),
}
"""verl names resolved on first access: ``name -> (agentloop module, attribute)``."""


async def get_trajectory_info(step: int, index: list[Any], validate: bool) -> list[dict[str, Any]]:
    """verl's per-row trajectory info: ``{step, sample_index, rollout_n, validate}`` for each row.

    ``rollout_n`` numbers the rows of one sample 0, 1, ... in batch order.  verl restarts the count
    whenever the index changes from the previous row; for verl's batches (rollouts of a sample are
    adjacent, from ``repeat(interleave=True)``) both give the same numbers.
    """
    return trajectory_info(np.asarray(list(index), dtype=object), int(step), bool(validate))


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    if name.startswith("__"):
        raise AttributeError(name)
    raise MissingVerlNameError(missing_verl_name("verl.experimental.agent_loop.agent_loop", name))


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
