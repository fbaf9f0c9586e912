"""Agent runners for the ``openai_agent`` loop: :func:`register_agent_runner`.

The loop itself lives in :mod:`agentloop.loops.openai_agent`; ``OpenAIAgentLoop`` and
``AgentRunner`` are re-exported here, their documented import path
(``_target_: agentloop.gateway.framework.OpenAIAgentLoop``). Spec:
docs/gateway.md#agent-runners-and-the-openai_agent-loop.
"""

from __future__ import annotations

from collections.abc import Callable

from agentloop.loops.base import AGENT_LOOPS
from agentloop.loops.openai_agent import AgentRunner, OpenAIAgentLoop
from agentloop.loops.runners import AGENT_RUNNERS
from agentloop.utils.registry import target_of

__all__ = ["AgentRunner", "OpenAIAgentLoop", "register_agent_runner"]


def register_agent_runner(name: str) -> Callable[[AgentRunner], AgentRunner]:
    """Decorator: samples with ``agent_name == name`` run this async callable through the gateway.

    Registers ``fn`` in :data:`~agentloop.loops.runners.AGENT_RUNNERS` (so a loop entry's
    ``runner:`` or a sample's ``extra_info.agent_runner`` can name it) and an ``openai_agent`` loop
    named ``name``.

    Raises:
        ConfigError: ``fn`` is not callable, or ``name`` is taken by another runner or agent loop.
    """

    def decorator(fn: AgentRunner) -> AgentRunner:
        loop = AGENT_LOOPS.find(name, local=True)
        # a runner whose loop entry was unregistered (``_agent_loop_registry.pop``) is stale:
        # replace it
        stale = loop is None or loop.kwargs.get("runner") is not AGENT_RUNNERS.get(name)
        AGENT_LOOPS.refuse_taken(name, target_of(OpenAIAgentLoop))  # before anything is registered
        AGENT_RUNNERS.add(name, fn, replace=stale)
        AGENT_LOOPS.add(name, OpenAIAgentLoop, runner=fn)
        return fn

    return decorator
