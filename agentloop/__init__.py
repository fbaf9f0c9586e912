"""agentloop: Ray-native distributed rollouts for agentic RL of LLMs.

Public API (names and signatures follow verl's agent loop)::

    from agentloop import AgentLoopManager, DataProto, AgentLoopBase, register

The names are imported on first use, so ``import agentloop`` (and the CLI's checks of a bad config
or dataset) does not pay for torch and Ray before it needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from agentloop.errors import (
    AgentLoopError,
    ConfigError,
    DatasetError,
    ServerError,
    UnknownAgentError,
)

if TYPE_CHECKING:
    from agentloop.batch.protocol import DataProto
    from agentloop.loops.base import AgentLoopBase, register
    from agentloop.loops.single_turn import SingleTurnAgentLoop
    from agentloop.rollout.manager import AgentLoopManager
    from agentloop.rollout.rollouter import Rollouter
    from agentloop.rollout.worker import AgentLoopWorker
    from agentloop.routing import AsyncLLMServerManager
    from agentloop.types import (
        AgentLoopMetrics,
        AgentLoopOutput,
        MultiTrajectoryAgentLoopOutput,
        RolloutStatus,
        StopReason,
        TokenOutput,
    )

__version__ = "0.1.0"

_LAZY = {
    "AgentLoopBase": "agentloop.loops.base", "register": "agentloop.loops.base",
    "SingleTurnAgentLoop": "agentloop.loops.single_turn",
    "AgentLoopManager": "agentloop.rollout.manager", "DataProto": "agentloop.batch.protocol",
    "AsyncLLMServerManager": "agentloop.routing", "AgentLoopMetrics": "agentloop.types",
    "AgentLoopOutput": "agentloop.types", "RolloutStatus": "agentloop.types",
    "MultiTrajectoryAgentLoopOutput": "agentloop.types", "StopReason": "agentloop.types",
    "TokenOutput": "agentloop.types", "AgentLoopWorker": "agentloop.rollout.worker",
    "Rollouter": "agentloop.rollout.rollouter",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agentloop' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "AgentLoopBase", "AgentLoopError", "AgentLoopManager", "AgentLoopMetrics", "AgentLoopOutput",
    "AgentLoopWorker", "AsyncLLMServerManager", "ConfigError", "DataProto", "DatasetError",
    "MultiTrajectoryAgentLoopOutput", "RolloutStatus", "Rollouter", "ServerError",
    "SingleTurnAgentLoop",
    "StopReason", "TokenOutput", "UnknownAgentError", "register",
]
