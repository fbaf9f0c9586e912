"""Weight updates of :class:`agentloop.servers.vllm.VLLMServer`: begin, load buckets, finish (or
abort).

Buckets go straight into the engine worker's memory through
:class:`agentloop.servers.weight_sync.VLLMWeightSyncExtension` (transport ``direct``: a
shared-memory segment, or the RPC message where none can be made), else as safetensors shards in a
temporary directory that the engine reloads at the end (transport ``file``).  Drain (default):
running requests finish on the old weights and new ones wait; keep (``server.weight_update: keep``):
running requests are frozen and go on after the update.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable
from typing import Any

from agentloop.errors import ServerError
from agentloop.servers.base import LOST_FOR_UPDATE, PauseGate
from agentloop.servers.inflight_update import InFlightUpdate
from agentloop.servers.weight_sync import (
    OpenWeightUpdate,
    SharedBucket,
    WeightBucket,
    tied_aliases,
    write_shard,
)

RaiseIfDead = Callable[[BaseException, str], None]
"""``(error, then)``: raise ServerDeadError (ending ``then``) when the engine died, else return."""


class VLLMWeights:
    """The weight-loading part of a vLLM server: the open update, the version being served, the
    transport.

    Args:
        server_index: for error messages.
        engine: returns the server's vLLM ``AsyncLLM`` (None before the server starts).
        gate: the server's pause gate (a paused server's engine stays paused after an update).
        inflight: the server's keep-mode part (keep: running requests are frozen, not drained).
        engine_dead: whether the engine died (a dead engine cannot resume).
        raise_if_dead: turns an error met on a dead engine into ServerDeadError.
    """

    def __init__(
        self, server_index: int, engine: Callable[[], Any], gate: PauseGate,
        inflight: InFlightUpdate, engine_dead: Callable[[], bool], raise_if_dead: RaiseIfDead,
    ) -> None:
        self.server_index = server_index
        self._engine = engine
        self.gate = gate
        self.inflight = inflight
        self._engine_dead = engine_dead
        self._raise_if_dead = raise_if_dead
        self.version = 0
        """Version of the weights being served (the server's ``global_steps``); published by
        :meth:`finish`."""
        self.transport = "file"
        """``direct`` (tensors into the engine worker's memory) or ``file`` (the fallback); set
        when it starts."""
        self.tie_word_embeddings = False
        """The model ties its output layer to the embeddings (``lm_head.weight`` loaded from
        them); set at start."""
        self.open: OpenWeightUpdate | None = None
        """The open update, None between updates."""

    async def begin(self, global_steps: int | None = None, transport: str = "auto") -> None:
        """Open a weight update (see :meth:`agentloop.servers.vllm.VLLMServer.begin_weight_update`).

        Raises:
            ServerError: an update is already open, ``transport`` is not available, or the engine
            failed to pause. ServerDeadError: the engine died.
        """
        if self.open is not None:
            raise ServerError(
                f"vLLM server {self.server_index}: a weight update (to "
                f"version {self.open.version}) "
                "is already open; finish_weight_update() it first"
            )
        chosen = self.transport if transport == "auto" else transport
        if chosen not in ("direct", "file") or (chosen == "direct" and self.transport != "direct"):
            raise ServerError(
                f"vLLM server {self.server_index}: weight transport "
                f"{transport!r} is not available "
                f"(this server has {self.transport!r}; use 'auto', 'direct' "
                f"or 'file')"
            )
        version = self.version + 1 if global_steps is None else int(global_steps)
        self.open = OpenWeightUpdate(version, chosen, time.perf_counter())
        engine = self._engine()
        try:
            # drain: running requests finish on the old weights; keep: they are frozen and go on
            # after the update
            await engine.pause_generation(
                mode="keep" if self.inflight.keep else "wait", clear_cache=False
            )
            if chosen == "direct":
                await engine.collective_rpc("agentloop_begin_weight_update")
            else:
                self.open.tmpdir = tempfile.TemporaryDirectory(prefix="agentloop-weights-")
        except Exception as e:
            await self.abort()
            self._raise_if_dead(e, LOST_FOR_UPDATE)
            raise ServerError(
                f"vLLM server {self.server_index}: could not open a weight update: {e}"
            ) from e

    async def load(self, bucket: WeightBucket) -> None:
        """Load one bucket of the open update (HF names; any order; a layer may straddle buckets).

        Raises:
            ServerError: no update is open, or loading failed (the update is closed).
            ServerDeadError: the engine died.
        """
        update = self._require("load_weight_bucket")
        aliases = tied_aliases(bucket, self.tie_word_embeddings)
        try:
            if update.transport == "direct":
                await self._load_direct(bucket, aliases)
            else:
                write_shard(bucket, aliases, update)
        except Exception as e:
            await self.abort()
            self._raise_if_dead(e, LOST_FOR_UPDATE)
            raise ServerError(
                f"vLLM server {self.server_index}: loading weights "
                f"{bucket.names[:3]}... failed: {e}; "
                "the engine may now mix old and new weights, run the update "
                "again"
            ) from e
        update.tensors += len(bucket)
        update.nbytes += bucket.nbytes

    async def finish(self) -> dict[str, Any]:
        """Apply the open update, reset the prefix cache (not in keep mode), publish its version and
        resume generation.  Returns what was loaded: version, transport, tensors, bytes, seconds.

        Raises:
            ServerError: no update is open, or applying it failed (the update is closed, the version
            kept). ServerDeadError: the engine died.
        """
        update = self._require("finish_weight_update")
        engine = self._engine()
        try:
            if update.transport == "direct":
                await engine.collective_rpc("agentloop_finish_weight_update")
            elif update.tensors:
                await self._reload_from(update.tmpdir.name)  # type: ignore[union-attr]
            # keep: cached prefixes stay in use, as the running requests' KV does
            if not self.inflight.keep:
                await engine.reset_prefix_cache()
            elif self.inflight.counts_tokens:
                # the engine is still frozen: counts are exact
                self.inflight.record_switch(engine, update.version)
        except Exception as e:
            await self._close()
            self._raise_if_dead(e, LOST_FOR_UPDATE)
            raise ServerError(
                f"vLLM server {self.server_index}: applying the weight update failed: {e}"
            ) from e
        self.version = update.version
        await self._close()
        return {"version": update.version, "transport": update.transport, "tensors": update.tensors,
                "bytes": update.nbytes, "seconds": time.perf_counter() - update.started}

    async def abort(self) -> None:
        """Close an open weight update without publishing its version and resume generation (a no-op
        when none is open).  Layers that got all their tensors keep the new values: run the update
        again."""
        update = self.open
        if update is None:
            return
        if update.transport == "direct":  # put back the layers that were not touched yet
            with contextlib.suppress(Exception):
                await self._engine().collective_rpc("agentloop_finish_weight_update")
        await self._close()

    async def _load_direct(self, bucket: WeightBucket, aliases: dict[str, str]) -> None:
        """Through a shared-memory segment, or inside the RPC message where none can be made."""
        engine = self._engine()
        shared = SharedBucket.create(bucket)
        if shared is None:
            await engine.collective_rpc("agentloop_load_weights", args=(bucket.to_wire(), aliases))
            return
        try:
            await engine.collective_rpc("agentloop_load_shared",
                                        args=(shared.path, shared.size, shared.layout, aliases))
        finally:
            shared.close()

    def _require(self, method: str) -> OpenWeightUpdate:
        if self.open is None:
            raise ServerError(
                f"vLLM server {self.server_index}: {method}() without an open "
                f"weight update; "
                "call begin_weight_update() first"
            )
        return self.open

    async def _reload_from(self, path: str) -> None:
        if self.transport == "direct":  # our extension is there: quiet, and the model path is kept
            await self._engine().collective_rpc("agentloop_reload_weights_from", args=(path,))
        else:
            await self._engine().collective_rpc(
                "reload_weights", kwargs={"weights_path": path, "is_checkpoint_format": True}
            )

    async def _close(self) -> None:
        """Close the open update (whatever state it is in) and let generation go on."""
        update, self.open = self.open, None
        if update is not None and update.tmpdir is not None:
            update.tmpdir.cleanup()
        if not self.gate.paused:  # paused: the engine stays paused until resume()
            try:
                await self._engine().resume_generation()
            except Exception:
                # a dead engine cannot resume: the caller reports that instead
                if not self._engine_dead():
                    raise
