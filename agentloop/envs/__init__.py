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
from agentloop.envs.resolve import (
    ENV_AGENT,
    EnvChoice,
    check_env_config,
    check_env_samples,
    env_spec,
    resolve_env,
)

__all__ = [
    "ENVS", "AssistantTurn", "EnvReset", "EnvStep", "Environment", "Message", "register_env",
    "ENV_AGENT", "EnvChoice", "check_env_config", "check_env_samples", "env_spec", "resolve_env",
]
