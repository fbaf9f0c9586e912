"""FaultMetrics: the ``agent_loop/faults/*`` metrics of a batch and the state of the manager's pool.

The dispatcher, the server supervisor and the gateway pool count their faults cumulatively;
:meth:`FaultMetrics.take` turns those counts into what happened since the previous batch (the
metric names are docs/faults.md's).
"""

from __future__ import annotations

from agentloop.cluster.supervisor import ServerSupervisor
from agentloop.rollout.dispatcher import Dispatcher
from agentloop.rollout.gateway_pool import GatewayPool


class FaultMetrics:
    """Fault counts of one manager's parts.

    Args:
        workers: the dispatcher (worker deaths, retries, hangs: ``fault_counts``).
        supervisor: the server supervisor (restarts, hangs, servers down).
        gateways: the gateway pool (gateways replaced, hung).
    """

    def __init__(
        self, workers: Dispatcher, supervisor: ServerSupervisor, gateways: GatewayPool
    ) -> None:
        self.workers = workers
        self.supervisor = supervisor
        self.gateways = gateways
        self._totals: dict[str, int] = {}

    def take(self, failovers: int) -> dict[str, float]:
        """``agent_loop/faults/*``: failovers (``failovers``, the batch's), retries and restarts
        since the previous call, servers now down."""
        counts = {
            **self.workers.fault_counts,
            "servers_restarted": self.supervisor.counts["server_restarts"],
            "servers_hung": self.supervisor.counts["servers_hung"],
            "gateways_replaced": self.gateways.replaced, "gateways_hung": self.gateways.hung,
        }
        before, self._totals = self._totals, dict(counts)
        metrics = {k: v - before.get(k, 0) for k, v in counts.items()}  # the counts are cumulative
        metrics.update(server_failovers=failovers, servers_down=len(self.supervisor.down))
        return {f"agent_loop/faults/{k}": float(v) for k, v in metrics.items()}

    def pool_state(self) -> dict[str, int]:
        """``servers_down``, ``servers_restarting``, ``servers_awaiting_weights`` (restarted after a
        weight update: they rejoin after the next one), ``workers``, ``workers_starting``."""
        waiting = len(self.supervisor.awaiting_weights())
        return {
            "servers_down": len(self.supervisor.down),
            "servers_restarting": len(self.supervisor.restarting) - waiting,
            "servers_awaiting_weights": waiting, "workers": len(self.workers.handles),
            "workers_starting": sum(1 for s in self.workers.slots if s.starting),
        }
