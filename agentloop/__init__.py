"""agentloop: Ray-native distributed rollouts for agentic RL of LLMs.

Public API (names and signatures follow verl's agent loop)::

    from agentloop import AgentLoopManager, DataProto, AgentLoopBase, register
"""

from agentloop.errors import AgentLoopError, ConfigError, DatasetError, ServerError, UnknownAgentError
from agentloop.loops.base import AgentLoopBase, register
from agentloop.loops.single_turn import SingleTurnAgentLoop
from agentloop.manager import AgentLoopManager
from agentloop.protocol import DataProto
from agentloop.routing import AsyncLLMServerManager
from agentloop.types import AgentLoopMetrics, AgentLoopOutput, RolloutStatus, StopReason, TokenOutput
from agentloop.worker import AgentLoopWorker

__version__ = "0.1.0"

__all__ = [
    "AgentLoopBase",
    "AgentLoopError",
    "AgentLoopManager",
    "AgentLoopMetrics",
    "AgentLoopOutput",
    "AgentLoopWorker",
    "AsyncLLMServerManager",
    "ConfigError",
    "DataProto",
    "DatasetError",
    "RolloutStatus",
    "ServerError",
    "SingleTurnAgentLoop",
    "StopReason",
    "TokenOutput",
    "UnknownAgentError",
    "register",
]
