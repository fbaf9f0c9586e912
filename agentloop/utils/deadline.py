"""Awaiting with a time limit: no task per call, and for long limits no event-loop timer per call.

``asyncio.wait_for`` wraps what it awaits in a new task (a task, a timer, two callbacks and an
event-loop iteration per call); a tool turn made three such calls (create, execute, release).
:func:`within` uses ``asyncio.timeout`` (Python 3.11+) for limits under :data:`COARSE_ABOVE`
seconds, which arms one event-loop timer per call that cancels the current task, and falls back to
``wait_for`` on 3.10.  Longer limits (the 30 s tool timeout, minutes-long sample timeouts) are
watched by one :class:`_Watchdog` per event loop: entering the limit is a set insert, leaving it a
removal, and the watchdog wakes at the earliest deadline it holds (one timer, not one per call: an
event loop's timer heap kept every cancelled 30 s timer for 30 s, ~9 µs a call on a busy worker).
A limit the watchdog holds may fire up to :data:`WATCH_SLACK` seconds late.  Either way an expired
limit raises ``asyncio.TimeoutError`` and the awaited work is cancelled before it returns; a limit
expiring together with an outer one or a caller's cancel behaves as ``asyncio.timeout`` does (the
outer cancel wins).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")

_timeout: Any = getattr(asyncio, "timeout", None)

COARSE_ABOVE = 1.0
"""Limits of at least this many seconds go to the shared watchdog."""
WATCH_SLACK = 0.05
"""How late the watchdog may fire a limit (a deadline this close to its next wake-up does not
move it)."""


class _Deadline:
    __slots__ = ("task", "when", "fired")

    def __init__(self, task: asyncio.Task, when: float) -> None:
        self.task, self.when, self.fired = task, when, False


class _Watchdog:
    """The deadlines of one event loop, checked at the earliest of them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # the loop and the timer (which holds the loop) are held weakly: a strong reference would
        # keep every finished loop alive as the weak map's value
        self.loop = weakref.ref(loop)
        self.deadlines: set[_Deadline] = set()
        self.handle: weakref.ref[asyncio.TimerHandle] | None = None
        self.wake_at = float("inf")

    def add(self, deadline: _Deadline) -> None:
        self.deadlines.add(deadline)
        if deadline.when < self.wake_at - WATCH_SLACK:
            self._wake(deadline.when)

    def remove(self, deadline: _Deadline) -> None:
        # the timer stays when nothing is left to watch (it then fires once and stops): limits
        # entered and left one after another would otherwise arm and cancel a timer each
        self.deadlines.discard(deadline)

    def _wake(self, when: float) -> None:
        handle = self.handle() if self.handle is not None else None
        if handle is not None:
            handle.cancel()
        loop = self.loop()
        self.wake_at = when
        self.handle = None if loop is None else weakref.ref(loop.call_at(when, self._check))

    def _check(self) -> None:
        self.handle, self.wake_at = None, float("inf")
        loop = self.loop()
        if loop is None:
            return
        now = loop.time()
        earliest = float("inf")
        for deadline in self.deadlines:
            if deadline.fired:
                continue
            if deadline.when <= now:
                deadline.fired = True
                deadline.task.cancel()
            elif deadline.when < earliest:
                earliest = deadline.when
        if earliest != float("inf"):
            self._wake(earliest)


_watchdogs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Watchdog] = (
    weakref.WeakKeyDictionary()
)


async def within(awaitable: Awaitable[T], timeout: float | None) -> T:
    """``await awaitable``, cancelled after ``timeout`` seconds (None or 0: no limit).

    Raises:
        asyncio.TimeoutError: the limit expired (the awaited work was cancelled).
    """
    if not timeout:
        return await awaitable
    if _timeout is None:  # Python 3.10
        return await asyncio.wait_for(awaitable, timeout)
    task = asyncio.current_task() if timeout >= COARSE_ABOVE else None
    if task is None:
        async with _timeout(timeout):
            return await awaitable
    loop = asyncio.get_running_loop()
    try:
        watchdog = _watchdogs.get(loop)
        if watchdog is None:
            watchdog = _watchdogs[loop] = _Watchdog(loop)
    except TypeError:  # a loop that takes no weak reference: one timer per call
        async with _timeout(timeout):
            return await awaitable
    deadline = _Deadline(task, loop.time() + timeout)
    cancelling = task.cancelling()
    watchdog.add(deadline)
    try:
        result = await awaitable
    except asyncio.CancelledError as e:
        # ours alone (no outer limit or caller cancel pending): a timeout
        if deadline.fired and task.uncancel() <= cancelling:
            raise asyncio.TimeoutError() from e
        raise
    finally:
        watchdog.remove(deadline)
    if deadline.fired:  # fired as the work returned: our cancel request is withdrawn
        task.uncancel()
    return result
