"""ServerSleep: whether the manager's servers can sleep, whether they do, and sleep / wake-up.

Held by :class:`agentloop.rollout.manager.AgentLoopManager` (``manager.server_sleep``), whose
``sleep`` / ``wake_up`` / ``can_sleep`` / ``sleeping`` are this class's.  Spec: docs/concepts.md
(``free_cache_engine``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from agentloop.cluster.placement import ServerGroup

# the manager's logger: the once-per-manager "cannot sleep" record is the manager's, as before
logger = logging.getLogger("agentloop.rollout.manager")

EachServer = Callable[..., Any]
"""``each(method, only=mask)``: ``method`` on the serving servers where ``mask`` is True."""


class ServerSleep:
    """The sleep state of a server group.

    Args:
        servers: the manager's servers (their ``device`` is named in the "cannot sleep" record).
        support: per server, whether it releases accelerator memory when put to sleep.
        each: runs a server method on the servers (the manager's ``_each_server``).
    """

    def __init__(self, servers: ServerGroup, support: list[bool], each: EachServer) -> None:
        self.servers = servers
        self.support = support
        self._each = each
        self._sleeping = False
        self._noop_logged = False

    @property
    def can_sleep(self) -> bool:
        """Whether every server really releases accelerator memory on :meth:`sleep` (each declares
        ``supports_sleep``): vLLM on CUDA with ``free_cache_engine``; not the CPU engine."""
        return all(self.support)

    @property
    def sleeping(self) -> bool:
        """Whether the servers are asleep: True from :meth:`sleep` until :meth:`wake_up`.  Always
        False where no server can sleep (nothing was released, so there is nothing to wake)."""
        return self._sleeping

    def wake_up(self) -> None:
        """Wake the servers :meth:`sleep` put to sleep, re-acquiring their memory (no-op when
        none sleeps)."""
        if self._sleeping:
            self._each("wake_up", only=self.support)
            self._sleeping = False

    def sleep(self) -> None:
        """Put every server that can sleep to sleep, freeing its accelerator memory.  Servers that
        cannot (``can_sleep`` False) are left running; that is logged once, not on every call."""
        if self._sleeping:
            return
        if not self.can_sleep and not self._noop_logged:
            self._noop_logged = True
            device = self.servers.device
            log = logger.warning if device == "cuda" else logger.info
            log(
                "AgentLoopManager.sleep: %d of %d servers cannot sleep (%s engine%s); "
                "sleep/wake_up leave them running and their memory held",
                self.support.count(False), len(self.support), device,
                "" if device != "cuda" else ", free_cache_engine=false",
            )
        if any(self.support):
            self._each("sleep", only=self.support)
            self._sleeping = True
