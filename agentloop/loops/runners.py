"""The agent-runner registry of the ``openai_agent`` loop.

An agent runner is an async callable ``runner(*, base_url, api_key, raw_prompt, **sample_fields)`` that
runs a user's OpenAI-client agent for one sample (spec: docs/gateway.md).  Runners are registered with
``@register_agent_runner(name)`` (:mod:`agentloop.gateway.framework`) and named in a loop entry's
``runner:`` or a sample's ``extra_info.agent_runner`` by registered name or import path.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from agentloop.utils.registry import Registry

__all__ = ["AGENT_RUNNERS", "AgentRunner", "resolve_runner"]

AgentRunner = Callable[..., Awaitable[Any]]

AGENT_RUNNERS = Registry(
    "agent runner", decorator="register_agent_runner", expected="an async callable", check=callable,
    how="Register one with @agentloop.gateway.framework.register_agent_runner(name), or give its import "
        "path (pkg.module:fn).",
)
"""Agent runners by name (filled by ``@register_agent_runner``)."""


def resolve_runner(spec: Any, where: str) -> AgentRunner | None:
    """``spec`` as a runner: None or a callable as given; a string is a registered runner name, else an
    import path (``pkg.module:fn`` or ``pkg.module.fn``).

    Raises:
        ConfigError: prefixed by ``where``: an unknown name (with the registered ones), a path that does
            not import, or an object that is not callable.
    """
    if spec is None or callable(spec):
        return spec
    return AGENT_RUNNERS.resolve(str(spec), where)
