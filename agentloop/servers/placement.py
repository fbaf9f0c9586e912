"""The documented import path of :mod:`agentloop.cluster.placement` (re-exports only)."""

from agentloop.cluster.placement import (  # noqa: F401
    PLACEMENT_STRATEGIES,
    SERVER_CLASSES,
    ServerGroup,
    ServerSlot,
    count_servers,
    cpu_bind_env,
    create_server_actor,
    detect_device,
    launch_servers,
    sleep_support,
    start_standalone_servers,
    stop_servers,
)

__all__ = [
    "PLACEMENT_STRATEGIES", "SERVER_CLASSES", "ServerGroup", "ServerSlot", "count_servers",
    "cpu_bind_env", "create_server_actor", "detect_device", "launch_servers", "sleep_support",
    "start_standalone_servers", "stop_servers",
]
