"""Routing replay's start-up checks, re-exported from :mod:`agentloop.config.routing_replay` (where
the server backends can import them too)."""

from agentloop.config.routing_replay import (  # noqa: F401 (re-exports)
    EXPERT_KEYS,
    KEY,
    TOP_K_KEYS,
    check_routing_replay,
    moe_shape,
    read_model_config,
)
