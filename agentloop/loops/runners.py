"""The agent-runner registry of the ``openai_agent`` loop.

An agent runner is an async callable ``runner(*, base_url, api_key, raw_prompt, **sample_fields)``
that runs a user's agent for one sample (spec: docs/gateway.md); a runner that takes
``anthropic_base_url`` (by name or ``**kwargs``) also gets the session root for Anthropic clients.
Runners are registered with ``@register_agent_runner(name)`` (:mod:`agentloop.gateway.framework`)
and named in a loop entry's ``runner:`` or a sample's ``extra_info.agent_runner`` by registered name
or import path.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from agentloop.utils.registry import Registry

__all__ = ["AGENT_RUNNERS", "AgentRunner", "accepts_keyword", "resolve_runner"]

AgentRunner = Callable[..., Awaitable[Any]]

AGENT_RUNNERS = Registry(
    "agent runner",
    decorator="register_agent_runner",
    expected="an async callable",
    check=callable,
    how="Register one with @agentloop.gateway.framework.register_agent_runner(name), or "
    "give its import "
    "path (pkg.module:fn).",
)
"""Agent runners by name (filled by ``@register_agent_runner``)."""


def resolve_runner(spec: Any, where: str) -> AgentRunner | None:
    """``spec`` as a runner: None or a callable as given; a string is a registered runner name, else
    an import path (``pkg.module:fn`` or ``pkg.module.fn``).

    Raises:
        ConfigError: prefixed by ``where``: an unknown name (with the registered ones), a path that
        does
            not import, or an object that is not callable.
    """
    if spec is None or callable(spec):
        return spec
    return AGENT_RUNNERS.resolve(str(spec), where)


def accepts_keyword(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` takes the keyword argument ``name`` (a parameter of that name, or
    ``**kwargs``); False when its signature cannot be read."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    if name in params and params[name].kind in (inspect.Parameter.KEYWORD_ONLY,
                                                inspect.Parameter.POSITIONAL_OR_KEYWORD):
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
