"""Awaiting with a time limit, without a task per call.

``asyncio.wait_for`` wraps what it awaits in a new task (a task, a timer, two callbacks and an
event-loop iteration per call); a tool turn made three such calls (create, execute, release).
:func:`within` uses ``asyncio.timeout`` (Python 3.11+), which arms one timer that cancels the
current task, and falls back to ``wait_for`` on 3.10.  Either way an expired limit raises
``asyncio.TimeoutError`` and the awaited work is cancelled before it returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")

_timeout: Any = getattr(asyncio, "timeout", None)


async def within(awaitable: Awaitable[T], timeout: float | None) -> T:
    """Await ``awaitable``, cancelled after ``timeout`` seconds (None or 0: no limit).

    Raises:
        asyncio.TimeoutError: the limit expired (the awaited work was cancelled).
    """
    if not timeout:
        return await awaitable
    if _timeout is None:  # Python 3.10
        return await asyncio.wait_for(awaitable, timeout)
    async with _timeout(timeout):
        return await awaitable
