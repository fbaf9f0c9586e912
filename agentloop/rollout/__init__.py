"""Orchestration on the driver and in the workers:
:class:`~agentloop.rollout.manager.AgentLoopManager` (what a trainer calls), the
:class:`~agentloop.rollout.dispatcher.Dispatcher` that spreads groups of samples over the worker
actors and handles their faults, the :class:`~agentloop.rollout.worker.AgentLoopWorker` actors that
run one agent loop per sample, the weight-sync component, and the asynchronous
:class:`~agentloop.rollout.rollouter.Rollouter`.  Spec: docs/architecture.md."""
