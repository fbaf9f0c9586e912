"""Coalescing generate calls to one server actor into one Ray call.

A worker running hundreds of agent loops issues their first turns in the same event-loop iteration.
One Ray actor call per request costs a task submission, a scheduling round and a result object each;
on small CPU boxes that is a visible share of the engine's time.  :class:`ServerCallBatcher`
collects the requests submitted during one loop iteration and sends them as one ``generate_batch``
call (a Ray streaming generator, see :class:`agentloop.servers.base.GenerateBatcher`); results come
back in groups as they finish, so a short request never waits for a long one.  A lone request takes
the plain ``generate`` call.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from agentloop.errors import ServerError


class ServerCallBatcher:
    """Batches ``generate`` calls to one server actor (see the module docstring).

    Args:
        handle: the server's Ray actor handle.
        server_index: for error messages.
        max_batch: a call leaves as soon as this many requests are waiting, so the engine starts on
            the first ones while the caller is still preparing the rest of its batch.
    """

    def __init__(self, handle: Any, server_index: int, max_batch: int = 64) -> None:
        self.handle = handle
        self.server_index = server_index
        self.max_batch = max_batch
        self._pending: list[tuple[dict[str, Any], asyncio.Future]] = []
        self._tasks: set[asyncio.Task] = set()
        self.num_calls = 0
        self.num_requests = 0

    def submit(self, kwargs: dict[str, Any]) -> asyncio.Future:
        """Queue one request; the future resolves to its TokenOutput (or raises its error)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((kwargs, future))
        if len(self._pending) >= self.max_batch:
            self._flush()  # the server starts on these while the caller prepares the rest
        return future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        batch = [(kw, fut) for kw, fut in batch if not fut.done()]
        if not batch:
            return
        self.num_calls += 1
        self.num_requests += len(batch)
        # The Ray call is submitted here, synchronously, not in the task's first step: that step
        # would only run after every task already queued in this loop iteration (e.g. the rest of
        # a batch's agent loops rendering their prompts).
        if len(batch) == 1:
            task = asyncio.ensure_future(
                self._run_one(self.handle.generate.remote(**batch[0][0]), batch[0][1])
            )
        else:
            stream = self.handle.generate_batch.options(num_returns="streaming").remote(
                [kw for kw, _ in batch]
            )
            task = asyncio.ensure_future(self._run_many(stream, batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_one(self, ref: Any, future: asyncio.Future) -> None:
        try:
            result = await ref
        # handed to the waiting caller (the router maps a dead server)
        except Exception as e:  # noqa: BLE001
            _settle(future, exc=e)
        else:
            _settle(future, result=result)

    async def _run_many(
        self, stream: Any, batch: list[tuple[dict[str, Any], asyncio.Future]]
    ) -> None:
        try:
            async for ref in stream:
                for index, result in await ref:
                    kwargs, future = batch[index]
                    if isinstance(result, Exception):
                        _settle(future, exc=result)
                    else:
                        _settle(future, result=result)
        # the whole call failed: every waiting request gets the error
        except Exception as e:  # noqa: BLE001
            for _, future in batch:
                _settle(future, exc=e)
        finally:
            for kwargs, future in batch:
                _settle(
                    future,
                    exc=ServerError(
                        f"server {self.server_index} ended the batch without answering request "
                        f"{kwargs['request_id']}"
                    ),
                )


def _settle(
    future: asyncio.Future, *, result: Any = None, exc: BaseException | None = None
) -> None:
    if future.done():
        return
    with contextlib.suppress(asyncio.InvalidStateError):
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
