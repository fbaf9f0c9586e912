"""Agent runners for the ``openai_agent`` loop: :func:`register_agent_runner`.

The loop itself lives in :mod:`agentloop.loops.openai_agent`; ``OpenAIAgentLoop`` and ``AgentRunner`` are
re-exported here, their documented import path (``_target_: agentloop.gateway.framework.OpenAIAgentLoop``).
Spec: docs/gateway.md#agent-runners-and-the-openai_agent-loop.
"""

from __future__ import annotations

from collections.abc import Callable

from agentloop.errors import ConfigError
from agentloop.loops.base import _agent_loop_registry
from agentloop.loops.openai_agent import AgentRunner, OpenAIAgentLoop

__all__ = ["AgentRunner", "OpenAIAgentLoop", "register_agent_runner"]


def register_agent_runner(name: str) -> Callable[[AgentRunner], AgentRunner]:
    """Decorator: samples with ``agent_name == name`` run this async callable through the gateway."""

    def decorator(fn: AgentRunner) -> AgentRunner:
        if not callable(fn):
            raise ConfigError(f"@register_agent_runner({name!r}) must decorate an async callable, got {fn!r}")
        _agent_loop_registry[name] = {"_target_": f"{OpenAIAgentLoop.__module__}.OpenAIAgentLoop",
                                      "_class_": OpenAIAgentLoop, "runner": fn}
        return fn

    return decorator
