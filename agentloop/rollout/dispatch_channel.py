""":class:`~agentloop.rollout.dispatcher.DispatchRun`'s polling while rows come back on the result
channel (``agent.result_channel: tcp``; :mod:`agentloop.rollout.result_channel`)."""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray

if TYPE_CHECKING:
    from agentloop.rollout.dispatch_parts import Dispatch, Finished

__all__ = ["CHANNEL_GRACE_S", "CHANNEL_LOOK_S", "MIXED_LOOK_S", "ChannelPolling"]

CHANNEL_LOOK_S = 0.05
"""While every dispatch's rows come on the result channel: how often the streams are looked at
anyway (a worker's error that closes no connection)."""
MIXED_LOOK_S = 0.005
"""While some come through Ray (a worker not connected): how often the streams are looked at."""
CHANNEL_GRACE_S = 10.0
"""How long rows sent on the channel may take to arrive after their stream ended (else the
dispatch is lost: its groups run again)."""


class ChannelPolling:
    """The result-channel half of a DispatchRun's poll (a mixin: the run provides the rest)."""

    dispatcher: Any
    open: dict[Any, Dispatch]
    by_token: dict[int, Dispatch]
    _take: Callable[..., list[Finished]]
    _finish: Callable[..., list[Finished]]
    _lost: Callable[[Dispatch, str], list[Finished]]
    _drop: Callable[[Dispatch], None]
    _hung_past_deadline: Callable[[], list[Finished]]
    _streams_looked_at: float = 0.0
    """When :meth:`_poll_channel` last looked at the streams (``time.monotonic()``)."""

    def _poll_channel(self, waits: list[float], end: float | None) -> list[Finished]:
        """:meth:`poll` while rows come on the result channel: wait on it (it wakes for rows and
        for a closed connection), then look at the streams without waiting (a dead worker's error,
        rows a worker could not send, a stream that ended)."""
        channel = self.dispatcher.channel
        assert channel is not None
        streaming = [x for x in self.open.values() if x.ended_at is None]
        on_channel = all(x.token is not None and channel.connected(x.worker_id) for x in streaming)
        wait = min([*waits, CHANNEL_LOOK_S if on_channel else MIXED_LOOK_S])
        finished: list[Finished] = []
        for token, payload in channel.take(set(self.by_token), max(0.0, wait)):
            dispatch = self.by_token.get(token)
            if dispatch is not None:  # not dropped by an earlier frame's fault
                local, rows, stats = pickle.loads(payload)
                finished += self._take(
                    dispatch, lambda d=dispatch, a=(local, rows, stats): self._finish(d, *a)
                )
        now = time.monotonic()
        for dispatch in [x for x in self.open.values() if x.ended_at is not None]:
            if now - dispatch.ended_at > CHANNEL_GRACE_S:  # type: ignore[operator]
                self._drop(dispatch)
                finished += self._lost(
                    dispatch, f"its stream ended and the rows it sent on the result channel did "
                    f"not arrive within {CHANNEL_GRACE_S:g} s")
        # the streams too: when no frame came, or at least every CHANNEL_LOOK_S while frames keep
        # coming (a dead worker's groups must not wait for a quiet moment)
        if not finished or now - self._streams_looked_at >= CHANNEL_LOOK_S:
            self._streams_looked_at = now
            refs = [r for r, x in self.open.items() if x.ended_at is None]
            ready = ray.wait(refs, num_returns=1, timeout=0)[0] if refs else []
            if ready:
                finished += self._take(self.open[ready[0]])
        if not finished and end is not None and time.monotonic() >= end:
            return self._hung_past_deadline()
        return finished
