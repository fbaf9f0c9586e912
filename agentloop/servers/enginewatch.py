"""No request waits forever on a dead engine.

vLLM is meant to fail its requests when its engine-core process dies, but it does not always: requests can
wait for outputs that never come (measured with vLLM 0.32 CPU and the tiny model: the engine SIGKILLed as soon
as a request was in flight on it left all 4 of its requests unanswered in 5 of 5 rounds, 2 of 3 with
``gc_freeze`` off, and a batch hung for good before this watch existed).  :class:`EngineWatch` keeps
the tasks of the requests running on a server and, once the engine is seen dead (polled every ``interval``
seconds: nothing on the per-token path), cancels them; the server turns that cancellation into
:class:`~agentloop.servers.base.ServerDeadError`, so the router fails the request over as for any dead engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)


class EngineWatch:
    """Cancel the running requests of a server whose engine died (see the module docstring).

    Args:
        is_dead: True once the engine cannot answer any more.
        interval: seconds between two looks at ``is_dead``.
    """

    def __init__(self, is_dead: Callable[[], bool], interval: float = 1.0) -> None:
        self.is_dead = is_dead
        self.interval = interval
        self._running: set[asyncio.Task] = set()
        self._cut: weakref.WeakSet[asyncio.Task] = weakref.WeakSet()
        self._watcher: asyncio.Task | None = None

    def start(self) -> None:
        """Start watching (inside the server's event loop)."""
        if self._watcher is None:
            self._watcher = asyncio.ensure_future(self._watch())

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """Around a request's wait for the engine: its task is cancelled if the engine dies meanwhile."""
        task = asyncio.current_task()
        if task is None:
            yield
            return
        self._running.add(task)
        try:
            yield
        finally:
            self._running.discard(task)

    def cut_by_death(self, error: BaseException) -> bool:
        """Whether ``error`` is this watch's cancellation of the current task (then the task is un-cancelled, so
        the caller may raise another error in its place)."""
        task = asyncio.current_task()
        if not isinstance(error, asyncio.CancelledError) or task is None or task not in self._cut:
            return False
        self._cut.discard(task)
        uncancel = getattr(task, "uncancel", None)  # Python >= 3.11
        if uncancel is not None:
            uncancel()
        return True

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if self.is_dead():
                cut = [t for t in list(self._running) if t not in self._cut and not t.done()]
                for task in cut:
                    self._cut.add(task)
                    task.cancel()
                if cut:
                    logger.warning("the engine died with %d request(s) it will never answer; they are failed over",
                                   len(cut))
