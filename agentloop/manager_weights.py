"""The weight-update half of :class:`agentloop.manager.AgentLoopManager`: streamed updates to every server and
what they do to the requests in flight (``rollout.server.weight_update``: abort, drain or keep; docs/async.md)."""

from __future__ import annotations

import logging
from typing import Any

import ray

from agentloop.errors import ServerError, first_line

logger = logging.getLogger("agentloop.manager")


class WeightUpdateMixin:
    """:meth:`update_weights` and its helpers; the manager provides the attributes below."""

    rollout: Any
    supervisor: Any
    server_handles: list[Any]
    _paused: bool
    wake_up: Any
    _each_server: Any

    @property
    def sleeping(self) -> bool:  # the manager's (servers put to sleep)
        raise NotImplementedError

    _weight_version: int = 0
    """The version the servers serve (0 until the first :meth:`update_weights`)."""

    def update_weights(self, weights: Any, *, global_steps: int | None = None, bucket_mb: float = 512) -> int:
        """Load new policy weights into every server; returns the new weight version.

        ``weights``: a state dict or an iterable of ``(name, tensor)`` pairs with HF names (full, unsharded
        tensors, any device), read once and lazily.  They travel in buckets of about ``bucket_mb`` MiB: each
        bucket is put in the object store once and shared by all servers, the next one is packed while the
        servers load the current one, and the model is never one object.  Sleeping servers are woken first
        (and left awake).  New requests wait until the update is done and the prefix cache is reset.  What
        happens to the requests in flight is ``rollout.server.weight_update`` (docs/async.md): ``abort`` (the
        default; verl's fully-async partial rollout) cuts them (:meth:`pause`) and the routers re-issue them after
        the update with their tokens so far (per-token ``weight_versions``); ``drain`` lets them finish on the old
        weights first; ``keep`` (vLLM) freezes them and they go on with the new weights on their KV cache (prefix
        cache kept; per-token ``weight_versions``).  ``global_steps`` (default: the previous version + 1; servers start
        at 0) is what every later generation reports as ``extra_fields["global_steps"]`` and trajectories as
        ``min_global_steps`` / ``max_global_steps``.  Protocol and engine path: :mod:`agentloop.servers.weight_sync`.
        A server that dies during the update, or gives no answer to one of its steps within
        ``rollout.server.weight_update_timeout`` seconds, is taken out and restarted and the update goes on with
        the others (the restarted one loads the weights at the next update; docs/faults.md).
        """
        version = self._weight_version + 1 if global_steps is None else int(global_steps)
        if self.sleeping:
            self.wake_up()
        if self.rollout.server.get("weight_update") != "abort" or self._paused:  # paused by the caller: theirs
            return self._load_weights(weights, version, bucket_mb)                # to resume
        try:
            try:
                self._each_server("pause", for_update=True)  # cut what runs: re-issued after the resume
            except Exception as e:  # noqa: BLE001 - not a dead server (those are restarted): say what to do
                raise ServerError(
                    f"update_weights could not pause the servers for the update (rollout.server.weight_update: "
                    f"abort): {first_line(e)}. A server class of your own needs pause(for_update=...) "
                    "(agentloop.servers.base.LLMServer); or set actor_rollout_ref.rollout.server.weight_update: "
                    "drain") from e
            return self._load_weights(weights, version, bucket_mb)
        finally:  # also after a failed pause or load: no server is left holding requests
            self._each_server("resume")

    def set_weight_update(self, mode: str) -> None:
        """Switch ``rollout.server.weight_update`` (``abort`` | ``drain`` | ``keep``) for later updates, on the
        manager and every server (refused by a server while requests run on it or an update is open)."""
        from agentloop.servers.inflight_update import WEIGHT_UPDATE_MODES

        if mode not in WEIGHT_UPDATE_MODES:
            raise ValueError(f"weight_update must be one of {', '.join(WEIGHT_UPDATE_MODES)}, not {mode!r}")
        if mode == "keep" and self.rollout.name != "vllm":
            raise ValueError("weight_update: keep is implemented for vLLM only")
        if self.rollout.name == "vllm":
            ray.get([h.set_weight_update.remote(mode) for h in self.server_handles])
        self.rollout.server.weight_update = mode

    def _load_weights(self, weights: Any, version: int, bucket_mb: float) -> int:
        """:meth:`update_weights` once the servers are awake (and paused, for ``abort``)."""
        from agentloop.servers.weight_sync import iter_buckets

        self.supervisor.poll(self._weight_version)
        waiting = self.supervisor.awaiting_weights()  # restarted servers: they get the current weights too
        targets = {i: h for i, h in enumerate(self.server_handles) if i not in self.supervisor.down}
        targets.update(waiting)
        limit = self.rollout.server.get("weight_update_timeout")

        def settle(calls: dict[int, Any], what: str) -> dict[int, Any]:
            """Results of the servers that answered; the lost ones are restarted and dropped from the update."""
            results = self.supervisor.settle(calls, float(limit) if limit else None, what, dict(targets))
            for i in set(calls) - set(results):
                targets.pop(i, None)
            if not targets:
                raise ServerError(f"update_weights to version {version}: no rollout server is left to load the "
                                  "weights (each died or gave no answer; see the warnings above); call "
                                  "update_weights again once manager.recover() reports servers up again")
            return results

        self.supervisor.updating = True
        try:
            settle({i: h.begin_weight_update.remote(version) for i, h in targets.items()}, "begin_weight_update")
            loading: dict[int, Any] = {}
            for bucket in iter_buckets(weights, max(1, int(bucket_mb * 2**20))):
                ref = ray.put(bucket)  # packed while the servers still load the previous bucket
                settle(loading, "load_weight_bucket")
                loading = {i: h.load_weight_bucket.remote(ref) for i, h in targets.items()}
                del ref, bucket
            settle(loading, "load_weight_bucket")
            reports = settle({i: h.finish_weight_update.remote() for i, h in targets.items()}, "finish_weight_update")
        except BaseException:
            _abort_weight_updates(list(targets.values()))
            raise
        finally:
            self.supervisor.updating = False
        self._weight_version = version
        self.supervisor.weights_loaded([i for i in waiting if i in targets])
        logger.debug("weights updated to version %d: %s", version, reports)
        return version

    def _update_weights_whole(self, named_tensors: dict[str, Any], *, global_steps: int | None = None,
                              transport: str = "file") -> int:
        """The pre-streaming path, kept for benchmarks and as an escape hatch: the whole dict is one object,
        each server loads it as one bucket (``transport="file"``: through a temporary safetensors file)."""
        version = self._weight_version + 1 if global_steps is None else int(global_steps)
        if self.sleeping:
            self.wake_up()
        ref = ray.put(named_tensors)
        ray.get([s.update_weights.remote(ref, version, transport=transport) for s in self.server_handles])
        self._weight_version = version
        return version


def _abort_weight_updates(handles: list[Any]) -> None:
    """Close whatever weight update is still open on each server, so none stays paused (errors ignored: the
    caller re-raises the one that matters)."""
    for ref in [s.abort_weight_update.remote() for s in handles]:
        try:
            ray.get(ref, timeout=30)
        except Exception as e:  # noqa: BLE001 - best effort while another error propagates
            logger.warning("closing a failed weight update: %s", e)
