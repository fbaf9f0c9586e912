"""GatewayPool: the OpenAI gateway actors an AgentLoopManager owns, over their whole life.

Started before the first batch with a gateway agent (a loop with ``requires_gateway``), replaced
before a batch where dead, killed while a batch runs where hung, told of restarted servers, stopped
at shutdown; the workers get the current set each time it changes.  The gateway's HTTP stack
(fastapi) is imported only once a batch uses a gateway agent.  Spec: docs/gateway.md,
docs/faults.md.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import ray

from agentloop.config import GatewaySections
from agentloop.rollout.dispatcher import Dispatcher
from agentloop.utils.hangwatch import HangWatch


class GatewayPool:
    """The manager's gateway actors (:attr:`handles`; empty until :meth:`start`).

    Args:
        server_handles: the manager's server list (the same list object: a restarted server put in
            it is what a replacement gateway starts with).
        balancer: the shared balancer actor, or None (one server).
        workers: the manager's dispatcher, which hands the gateways to the workers.
    """

    def __init__(self, server_handles: list[Any], balancer: Any, workers: Dispatcher) -> None:
        self.handles: list[Any] = []
        self.server_handles = server_handles
        self.balancer = balancer
        self.workers = workers
        self.replaced = 0
        """Gateways replaced because they died (cumulative)."""
        self.hung = 0
        """Gateways killed because they hung (cumulative)."""
        self._hangs: HangWatch[int] = HangWatch()

    def start(self, sections: GatewaySections) -> list[Any]:
        """Start the gateway actors (``rollout.gateway``) unless started, and hand them to the
        workers; returns the actor handles."""
        if not self.handles:
            # heavy (the gateway's HTTP stack, fastapi): loaded only once a batch uses a
            # gateway agent
            from agentloop.gateway.actor import start_gateways

            self.handles = start_gateways(sections, self.server_handles, self.balancer)
            self.workers.broadcast("attach_gateways", self.handles, remember=True)
        return self.handles

    def replace_dead(self, sections: GatewaySections) -> None:
        """Gateway actors that died are replaced (before a batch), and the workers given the new
        set."""
        # heavy (the gateway's HTTP stack, fastapi): loaded only once a batch uses a gateway agent
        from agentloop.gateway.actor import replace_dead_gateways

        replaced = replace_dead_gateways(
            self.handles, sections, self.server_handles, self.balancer
        )
        if replaced:
            self.workers.broadcast("attach_gateways", self.handles, remember=True)
            self.replaced += replaced

    def watch(self, hang_s: float) -> None:
        """A look while a batch runs: a gateway that left a probe unanswered for ``hang_s`` seconds
        is killed (the workers told first), and replaced before the next batch."""
        if not self.handles:
            return
        # heavy (the gateway's HTTP stack, fastapi): loaded only once a batch uses a gateway agent
        from agentloop.gateway.actor import kill_hung_gateways

        self.hung += len(
            kill_hung_gateways(
                self.handles, self._hangs, hang_s,
                tell=functools.partial(self.workers.tell, "gateway_lost"),
            )
        )

    def swap_server(self, index: int, handle: Any) -> None:
        """Hand restarted server ``index`` to every gateway."""
        if not self.handles:
            return
        # heavy (the gateway's HTTP stack, fastapi): loaded only once a batch uses a gateway agent
        from agentloop.gateway.actor import tell_gateways

        tell_gateways(self.handles, index, handle)

    def shutdown(self) -> None:
        """Stop the gateways' HTTP servers (best effort) and kill their actors."""
        if not self.handles:
            return
        # best effort (a gateway may have died); all are killed next
        with contextlib.suppress(Exception):
            ray.get([g.shutdown.remote() for g in self.handles], timeout=30)
        for g in self.handles:
            ray.kill(g)
        self.handles = []
