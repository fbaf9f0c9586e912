"""OpenAI-compatible agent gateway: sessions, a branch-aware trajectory store, streaming.

See :mod:`agentloop.gateway.service` (the request flow), :mod:`agentloop.gateway.store` (the prefix
trie), :mod:`agentloop.gateway.app` (HTTP routes and error codes), :mod:`agentloop.gateway.actor`
(Ray actor + session placement) and :mod:`agentloop.gateway.framework` (the ``openai_agent`` loop).
Names are imported lazily, so registering the ``openai_agent`` loop does not load the HTTP stack.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "GatewayActor": "agentloop.gateway.actor", "GatewayManager": "agentloop.gateway.actor",
    "start_gateways": "agentloop.gateway.actor", "GatewayService": "agentloop.gateway.service",
    "SessionHandle": "agentloop.gateway.service", "OpenAIAgentLoop": "agentloop.gateway.framework",
    "register_agent_runner": "agentloop.gateway.framework",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'agentloop.gateway' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
