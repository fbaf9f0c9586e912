"""Environments for the ``env_agent`` loop: the protocol and the registry (docs/environments.md)."""

from agentloop.envs.base import (
    ENVS,
    AssistantTurn,
    Environment,
    EnvReset,
    EnvStep,
    Message,
    register_env,
)

__all__ = [
    "ENVS", "AssistantTurn", "EnvReset", "EnvStep", "Environment", "Message", "register_env",
]
