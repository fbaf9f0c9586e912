"""No request waits forever on a dead or hung engine.

:class:`EngineWatch` keeps the tasks of the requests running on a server and looks at the engine
every ``interval`` seconds (nothing on the per-token path). Once the engine is seen dead, it cancels
them; the server turns that cancellation into :class:`~agentloop.servers.base.ServerDeadError`, so
the router fails the request over. With ``stall_timeout`` set it also reads a progress counter: when
requests run, the server is not holding them (paused, updating weights) and the counter has not
moved for ``stall_timeout`` seconds, the engine is taken for hung: :attr:`EngineWatch.stalled` says
why, ``on_stall`` is called (the vLLM server kills its engine processes) and the running requests
are cut as for a dead engine.

Why (vLLM leaves requests unanswered when its engine dies or hangs; measurements):
docs/faults.md#the-engine-watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import psutil
import ray

logger = logging.getLogger(__name__)


class EngineWatch:
    """Cancel the running requests of a server whose engine died (see the module docstring).

    Args:
        is_dead: True once the engine cannot answer any more.
        interval: seconds between two looks at ``is_dead``.
        progress: a value that changes whenever the engine makes progress (e.g. its requests' token
        counts);
            None (or a callable returning None): no stall detection.
        stall_timeout: seconds without progress, while requests run and nothing holds them, after
        which the
            engine is taken for hung (None: never).
        holding: True while the server itself holds its running requests (paused, a weight update
        open). on_stall: called once, with the reason, when the engine is taken for hung (before the
        requests are cut).
    """

    def __init__(
        self, is_dead: Callable[[], bool], interval: float = 1.0, *,
        progress: Callable[[], Hashable | None] | None = None, stall_timeout: float | None = None,
        holding: Callable[[], bool] | None = None, on_stall: Callable[[str], object] | None = None,
    ) -> None:
        self.is_dead = is_dead
        self.interval = interval
        self.progress = progress
        self.stall_timeout = stall_timeout
        self.holding = holding
        self.on_stall = on_stall
        self.stalled: str | None = None
        """Why the engine was taken for hung (None while it was not)."""
        self._last: tuple[Hashable, float] | None = None  # (progress, when it was first seen)
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
        """Around a request's wait for the engine: its task is cancelled if the engine dies
        meanwhile."""
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
        """Whether ``error`` is this watch's cancellation of the current task (then the task is
        un-cancelled, so the caller may raise another error in its place)."""
        task = asyncio.current_task()
        if not isinstance(error, asyncio.CancelledError) or task is None or task not in self._cut:
            return False
        self._cut.discard(task)
        uncancel = getattr(task, "uncancel", None)  # Python >= 3.11
        if uncancel is not None:
            uncancel()
        return True

    def _look_for_stall(self, now: float) -> None:
        """Take the engine for hung once its progress stood still for ``stall_timeout`` s with
        requests running."""
        if self.stalled is not None or self.stall_timeout is None or self.progress is None:
            return
        running = sum(1 for t in self._running if not t.done())
        mark = (
            self.progress()
            if running and not (self.holding is not None and self.holding())
            else None
        )
        if mark is None:
            self._last = None
            return
        if self._last is None or self._last[0] != mark:
            self._last = (mark, now)
            return
        if now - self._last[1] >= self.stall_timeout:
            self.stalled = (
                f"the engine made no progress for {now - self._last[1]:.0f} s "
                f"with {running} request(s) "
                f"running (rollout.server.stall_timeout={self.stall_timeout:g})"
            )
            logger.error("%s: taken for hung; its requests are failed over", self.stalled)
            if self.on_stall is not None:
                try:
                    self.on_stall(self.stalled)
                except Exception:  # the requests are cut all the same
                    logger.exception("could not stop the hung engine")

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.interval)
            self._look_for_stall(loop.time())
            if self.stalled is not None or self.is_dead():
                cut = [t for t in list(self._running) if t not in self._cut and not t.done()]
                for task in cut:
                    self._cut.add(task)
                    task.cancel()
                if cut:
                    logger.warning(
                        "the engine %s with %d request(s) it will never answer; "
                        "they are failed over",
                        "hung" if self.stalled is not None else "died",
                        len(cut),
                    )


def engine_progress(engine: Any) -> tuple[int, int] | None:
    """A vLLM ``AsyncLLM``'s progress: (requests it holds, output tokens they have so far), read
    from its output processor, which every engine step updates; None where the engine or a vLLM
    version lacks it."""
    states = getattr(getattr(engine, "output_processor", None), "request_states", None)
    if not isinstance(states, dict):
        return None
    tokens = 0
    for state in list(states.values()):
        counter = getattr(state, "detokenizer", None)
        tokens += int(counter.num_output_tokens()) if counter is not None else 0
    return len(states), tokens


def kill_engine_processes() -> list[int]:
    """SIGKILL every process this one started (a vLLM server actor's engine core and its workers),
    so a hung engine frees its memory and its server reads as dead; returns their pids.  Only inside
    a Ray actor (every server the manager starts is its own actor, whose only children are its
    engine's): a server built in some other process kills nothing and is only marked hung."""
    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        logger.error(
            "the hung engine's processes are left running: this server is not a "
            "Ray actor of its own"
        )
        return []
    children = psutil.Process(os.getpid()).children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(children, timeout=10)
    logger.error("killed the hung engine's processes %s", [c.pid for c in children])
    return [c.pid for c in children]
