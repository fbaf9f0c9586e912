"""Where the worker pool used to live: it became the dispatcher (:class:`agentloop.dispatcher.Dispatcher`, the
same constructor arguments), and the worker actors themselves :mod:`agentloop.worker_slots`."""

from __future__ import annotations

from agentloop.dispatcher import Dispatcher as WorkerPool
from agentloop.dispatcher import ErrorRows
from agentloop.worker_slots import Spawn, WorkerSlot
from agentloop.worker_slots import WorkerSlot as _Slot  # the old private name, still used by tests

__all__ = ["ErrorRows", "Spawn", "WorkerPool", "WorkerSlot", "_Slot"]
