"""The manager's weight-sync component: streamed weight updates to every rollout server and what
they do to the requests in flight (``rollout.server.weight_update``: abort, drain or keep;
docs/async.md).

:class:`WeightSync` is held by :class:`agentloop.rollout.manager.AgentLoopManager`
(``manager.weights``); the manager's ``update_weights``, ``pause``, ``resume`` and
``set_weight_update`` delegate to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import ray

from agentloop.cluster.supervisor import ServerSupervisor
from agentloop.errors import ServerError, first_line
from agentloop.servers.inflight_update import WEIGHT_UPDATE_MODES
from agentloop.servers.weight_sync import iter_buckets

logger = logging.getLogger("agentloop.rollout.manager")


class WeightSync:
    """Loads new weights into the servers a supervisor watches, and pauses / resumes them.

    Args:
        supervisor: the servers (``supervisor.group.handles``); a server that dies or does not
        answer during an
            update is taken out and restarted by it, and the update goes on with the others.
        backend: ``rollout.name`` (``keep`` is vLLM's only).
        mode: ``rollout.server.weight_update``: ``abort``, ``drain`` or ``keep``.
        timeout_s: ``rollout.server.weight_update_timeout``: how long a server may take for one step
        (None: no
            limit).
        wake_up: called before every update (the manager's ``wake_up``: sleeping servers are woken
        and left awake).
    """

    def __init__(
        self, supervisor: ServerSupervisor, *, backend: str, mode: str, timeout_s: float | None,
        wake_up: Callable[[], None] = lambda: None,
    ) -> None:
        self.supervisor = supervisor
        self.backend = backend
        self.mode = mode
        self.timeout_s = timeout_s
        self.wake_up = wake_up
        self.version = 0
        """The version the servers serve (0 until the first update)."""
        self.paused = False
        """Between :meth:`pause` and :meth:`resume`."""

    @property
    def handles(self) -> list[Any]:
        """The servers' actor handles (a restarted server's handle replaces the dead one in
        place)."""
        return self.supervisor.group.handles

    def each(self, method: str, only: list[bool] | None = None, **kwargs: Any) -> dict[int, Any]:
        """``method`` on every serving server; a dead or silent one is restarted, not raised
        (supervisor.each)."""
        return self.supervisor.each(method, self.timeout_s, only, **kwargs)

    def pause(self) -> int:
        """Abort every in-flight engine request and hold new ones until :meth:`resume`; returns
        how many were cut."""
        self.paused = True
        return int(sum(self.each("pause").values()))

    def resume(self) -> None:
        """Let the servers run the held and re-issued requests again."""
        self.each("resume")
        self.paused = False

    def set_mode(self, mode: str) -> None:
        """Switch the weight-update mode for later updates, here and on every server.

        Raises:
            ValueError: not one of abort, drain, keep; or keep on a backend other than vLLM.
        """
        if mode not in WEIGHT_UPDATE_MODES:
            raise ValueError(
                f"weight_update must be one of {', '.join(WEIGHT_UPDATE_MODES)}, not {mode!r}"
            )
        if mode == "keep" and self.backend != "vllm":
            raise ValueError("weight_update: keep is implemented for vLLM only")
        if self.backend == "vllm":
            ray.get([h.set_weight_update.remote(mode) for h in self.handles])
        self.mode = mode

    def update(
        self, weights: Any, *, global_steps: int | None = None, bucket_mb: float = 512
    ) -> int:
        """Load ``weights`` (a state dict or ``(name, tensor)`` pairs, read once and lazily) into
        every server in buckets of about ``bucket_mb`` MiB; returns the new version
        (``global_steps``, default: previous + 1). ``abort`` cuts what runs first and resumes after
        (unless the caller paused: then the resume is theirs). The contract in full:
        :meth:`agentloop.rollout.manager.AgentLoopManager.update_weights`.

        Raises:
            ServerError: the servers could not be paused for an ``abort`` update, no server is left,
            or a server
                refused a step (the version is then unchanged and no update stays open).
        """
        version = self.version + 1 if global_steps is None else int(global_steps)
        self.wake_up()
        if self.mode != "abort" or self.paused:  # paused by the caller: theirs to resume
            return self._load(weights, version, bucket_mb)
        try:
            try:
                self.each("pause", for_update=True)  # cut what runs: re-issued after the resume
            # not a dead server (those are restarted): say what to do
            except Exception as e:  # noqa: BLE001
                raise ServerError(
                    f"update_weights could not pause the servers for the update "
                    f"(rollout.server.weight_update: "
                    f"abort): {first_line(e)}. A server class of your own needs "
                    f"pause(for_update=...) "
                    "(agentloop.servers.base.LLMServer); or set "
                    "actor_rollout_ref.rollout.server.weight_update: "
                    "drain"
                ) from e
            return self._load(weights, version, bucket_mb)
        finally:  # also after a failed pause or load: no server is left holding requests
            self.each("resume")

    def _load(self, weights: Any, version: int, bucket_mb: float) -> int:
        """:meth:`update` once the servers are awake (and paused, for ``abort``)."""
        self.supervisor.poll(self.version)
        # restarted servers: they get the current weights too
        waiting = self.supervisor.awaiting_weights()
        targets = {i: h for i, h in enumerate(self.handles) if i not in self.supervisor.down}
        targets.update(waiting)

        def settle(calls: dict[int, Any], what: str) -> dict[int, Any]:
            """Results of the servers that answered; the lost ones are restarted and dropped from
            the update."""
            results = self.supervisor.settle(calls, self.timeout_s, what, dict(targets))
            for i in set(calls) - set(results):
                targets.pop(i, None)
            if not targets:
                raise ServerError(
                    f"update_weights to version {version}: no rollout server "
                    f"is left to load the "
                    "weights (each died or gave no answer; see the warnings "
                    "above); call "
                    "update_weights again once manager.recover() reports "
                    "servers up again"
                )
            return results

        self.supervisor.updating = True
        try:
            settle(
                {i: h.begin_weight_update.remote(version) for i, h in targets.items()},
                "begin_weight_update",
            )
            loading: dict[int, Any] = {}
            for bucket in iter_buckets(weights, max(1, int(bucket_mb * 2**20))):
                ref = ray.put(bucket)  # packed while the servers still load the previous bucket
                settle(loading, "load_weight_bucket")
                loading = {i: h.load_weight_bucket.remote(ref) for i, h in targets.items()}
                del ref, bucket
            settle(loading, "load_weight_bucket")
            reports = settle(
                {i: h.finish_weight_update.remote() for i, h in targets.items()},
                "finish_weight_update",
            )
        except BaseException:
            _abort_weight_updates(list(targets.values()))
            raise
        finally:
            self.supervisor.updating = False
        self.version = version
        self.supervisor.weights_loaded([i for i in waiting if i in targets])
        logger.debug("weights updated to version %d: %s", version, reports)
        return version

    def update_whole(self, named_tensors: dict[str, Any], *, global_steps: int | None = None,
                     transport: str = "file") -> int:
        """The pre-streaming path, kept for benchmarks and as an escape hatch: the whole dict is one
        object, each server loads it as one bucket (``transport="file"``: through a temporary
        safetensors file)."""
        version = self.version + 1 if global_steps is None else int(global_steps)
        self.wake_up()
        ref = ray.put(named_tensors)
        ray.get([s.update_weights.remote(ref, version, transport=transport) for s in self.handles])
        self.version = version
        return version


def _abort_weight_updates(handles: list[Any]) -> None:
    """Close whatever weight update is still open on each server, so none stays paused (errors
    ignored: the caller re-raises the one that matters)."""
    for ref in [s.abort_weight_update.remote() for s in handles]:
        try:
            ray.get(ref, timeout=30)
        except Exception as e:  # noqa: BLE001 - best effort while another error propagates
            logger.warning("closing a failed weight update: %s", e)
