"""Weight updates of :class:`agentloop.servers.sglang.SGLangServer`: begin, load buckets, finish (or
abort).

An update drains: new requests wait (:meth:`SGLangWeights.wait`) while the running ones finish on
the old weights, then each bucket goes to the engine as tensors (SGLang's
``update_weights_from_tensor``), and the prefix (radix) cache is flushed before the new version is
published.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from agentloop.errors import ServerError
from agentloop.servers.base import LOST_FOR_UPDATE, PauseGate
from agentloop.servers.weight_sync import OpenWeightUpdate, WeightBucket

RaiseIfDead = Callable[[BaseException | None, str], None]
"""``(error, then)``: raise ServerDeadError (ending ``then``) when the engine's processes died,
else return."""


class SGLangWeights:
    """The weight-loading part of an SGLang server: the open update and the version being served.

    Args:
        server_index: for error messages.
        api: returns the server's engine API (raises ServerError when the server is not started);
        any object
            with ``load_tensors(named)`` and ``flush_cache()`` coroutines.
        gate: the server's pause gate (an update waits for the requests in flight).
        raise_if_dead: turns an error met on a dead engine into ServerDeadError.
    """

    def __init__(
        self, server_index: int, api: Callable[[], Any], gate: PauseGate, raise_if_dead: RaiseIfDead
    ) -> None:
        self.server_index = server_index
        self._api = api
        self.gate = gate
        self._raise_if_dead = raise_if_dead
        self.version = 0
        """Version of the weights being served (the server's ``global_steps``); published by
        :meth:`finish`."""
        self.open: OpenWeightUpdate | None = None
        """The open update, None between updates."""
        self._closed = asyncio.Event()
        self._closed.set()

    async def wait(self) -> None:
        """Return once no update is open (a new request waits here for the new weights)."""
        while not self._closed.is_set():
            await self._closed.wait()

    async def begin(self, global_steps: int | None = None, transport: str = "auto") -> None:
        """Open an update: new requests wait, the ones in flight finish on the old weights first.

        Raises:
            ServerError: an update is already open, or ``transport`` is not ``auto`` / ``direct``.
            ServerDeadError: the engine's processes died.
        """
        if self.open is not None:
            raise ServerError(
                f"SGLang server {self.server_index}: a weight update is "
                f"already open; "
                "finish_weight_update() it first"
            )
        if transport not in ("auto", "direct"):
            raise ServerError(
                f"SGLang server {self.server_index}: weight transport "
                f"{transport!r} is not available "
                "(SGLang loads tensors directly: use 'auto' or 'direct')"
            )
        self._raise_if_dead(None, LOST_FOR_UPDATE)
        version = self.version + 1 if global_steps is None else int(global_steps)
        self.open = OpenWeightUpdate(version, "direct", time.perf_counter())
        self._closed.clear()
        while self.gate.in_flight:  # let running requests finish on the weights they started with
            await asyncio.sleep(0.01)

    async def load(self, bucket: WeightBucket) -> None:
        """Load one bucket (HF names) into the engine.

        Raises:
            ServerError: no update is open, or the engine refused the tensors (the update is
            closed). ServerDeadError: the engine's processes died.
        """
        update = self.open
        if update is None:
            raise ServerError(
                f"SGLang server {self.server_index}: load_weight_bucket() "
                f"without an open weight "
                "update; call begin_weight_update() first"
            )
        try:
            await self._api().load_tensors(list(bucket.tensors()))
        except Exception as e:
            await self.abort()
            self._raise_if_dead(e, LOST_FOR_UPDATE)
            raise ServerError(
                f"SGLang server {self.server_index}: loading weights "
                f"{bucket.names[:3]}... failed: "
                f"{e}; run the update again"
            ) from e
        update.tensors += len(bucket)
        update.nbytes += bucket.nbytes

    async def finish(self) -> dict[str, Any]:
        """Flush the prefix cache, publish the version, let requests run; returns what was loaded
        (version, transport, tensors, bytes, seconds).

        Raises:
            ServerError: no update is open (or the flush failed: the update is closed, the version
            kept). ServerDeadError: the engine's processes died.
        """
        update = self.open
        if update is None:
            raise ServerError(
                f"SGLang server {self.server_index}: finish_weight_update() "
                f"without an open weight "
                "update; call begin_weight_update() first"
            )
        try:
            await self._api().flush_cache()
        except Exception as e:
            self._raise_if_dead(e, LOST_FOR_UPDATE)
            raise
        finally:
            self.open = None
            self._closed.set()
        self.version = update.version
        return {"version": update.version, "transport": "direct", "tensors": update.tensors,
                "bytes": update.nbytes, "seconds": time.perf_counter() - update.started}

    async def abort(self) -> None:
        """Close an open update without publishing its version (no-op when none is open)."""
        self.open = None
        self._closed.set()
