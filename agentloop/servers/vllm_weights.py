"""Weight updates of :class:`agentloop.servers.vllm.VLLMServer`: begin, load buckets, finish (or abort).

Buckets go straight into the engine worker's memory through
:class:`agentloop.servers.weight_sync.VLLMWeightSyncExtension` (transport ``direct``: a shared-memory segment, or
the RPC message where none can be made), else as safetensors shards in a temporary directory that the engine
reloads at the end (transport ``file``).  Drain (default): running requests finish on the old weights and new
ones wait; keep (``server.weight_update: keep``): running requests are frozen and go on after the update.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from typing import Any

from agentloop.errors import ServerError
from agentloop.servers.base import LOST_FOR_UPDATE
from agentloop.servers.weight_sync import (
    OpenWeightUpdate,
    SharedBucket,
    WeightBucket,
    Weights,
    iter_buckets,
    tied_aliases,
    write_shard,
)


class VLLMWeightUpdateMixin:
    """The weight-update methods of VLLMServer (its ``engine``, ``_gate``, ``_update``, ``global_steps``, ...)."""

    engine: Any
    _gate: Any
    _update: OpenWeightUpdate | None
    _sleeping: bool
    server_index: int
    global_steps: int
    weight_transport: str
    tie_word_embeddings: bool
    keep_kv_on_update: bool
    _counts_tokens: bool
    _record_switch: Any
    _raise_if_dead: Any
    _engine_dead: Any

    async def begin_weight_update(self, global_steps: int | None = None, *, transport: str = "auto") -> None:
        """Open a weight update: in-flight requests finish on the old weights, new ones wait until
        :meth:`finish_weight_update`.  ``global_steps`` becomes the served version at the end (default: the
        current one + 1); ``transport`` is ``auto`` (this server's :attr:`weight_transport`), ``direct`` or
        ``file``."""
        if self.engine is None:
            raise ServerError(f"vLLM server {self.server_index} is not started; call start() first")
        if self._sleeping:
            raise ServerError(f"vLLM server {self.server_index} is asleep: wake_up() before updating weights")
        if self._update is not None:
            raise ServerError(f"vLLM server {self.server_index}: a weight update (to version {self._update.version}) "
                              "is already open; finish_weight_update() it first")
        chosen = self.weight_transport if transport == "auto" else transport
        if chosen not in ("direct", "file") or (chosen == "direct" and self.weight_transport != "direct"):
            raise ServerError(f"vLLM server {self.server_index}: weight transport {transport!r} is not available "
                              f"(this server has {self.weight_transport!r}; use 'auto', 'direct' or 'file')")
        version = self.global_steps + 1 if global_steps is None else int(global_steps)
        self._update = OpenWeightUpdate(version, chosen, time.perf_counter())
        try:
            # drain: running requests finish on the old weights; keep: they are frozen and go on after the update
            await self.engine.pause_generation(mode="keep" if self.keep_kv_on_update else "wait", clear_cache=False)
            if chosen == "direct":
                await self.engine.collective_rpc("agentloop_begin_weight_update")
            else:
                self._update.tmpdir = tempfile.TemporaryDirectory(prefix="agentloop-weights-")
        except Exception as e:
            await self.abort_weight_update()
            self._raise_if_dead(e, LOST_FOR_UPDATE)
            raise ServerError(f"vLLM server {self.server_index}: could not open a weight update: {e}") from e

    async def load_weight_bucket(self, bucket: WeightBucket) -> None:
        """Load one bucket of the open update (HF names; any order; a layer may straddle buckets)."""
        update = self._require_update("load_weight_bucket")
        aliases = tied_aliases(bucket, self.tie_word_embeddings)
        try:
            if update.transport == "direct":
                await self._load_direct(bucket, aliases)
            else:
                write_shard(bucket, aliases, update)
        except Exception as e:
            await self.abort_weight_update()
            self._raise_if_dead(e, LOST_FOR_UPDATE)
            raise ServerError(f"vLLM server {self.server_index}: loading weights {bucket.names[:3]}... failed: {e}; "
                              "the engine may now mix old and new weights, run the update again") from e
        update.tensors += len(bucket)
        update.nbytes += bucket.nbytes

    async def finish_weight_update(self) -> dict[str, Any]:
        """Apply the update, reset the prefix cache, publish the new version and resume generation.
        Returns what was loaded: version, transport, tensors, bytes, seconds."""
        update = self._require_update("finish_weight_update")
        try:
            if update.transport == "direct":
                await self.engine.collective_rpc("agentloop_finish_weight_update")
            elif update.tensors:
                await self._reload_from(update.tmpdir.name)  # type: ignore[union-attr]
            if not self.keep_kv_on_update:  # keep: cached prefixes stay in use, as the running requests' KV does
                await self.engine.reset_prefix_cache()
            elif self._counts_tokens:
                self._record_switch(update.version)  # the engine is still frozen: the counts are exact
        except Exception as e:
            await self._abandon_update()
            self._raise_if_dead(e, LOST_FOR_UPDATE)
            raise ServerError(f"vLLM server {self.server_index}: applying the weight update failed: {e}") from e
        self.global_steps = update.version
        await self._abandon_update()
        return {"version": update.version, "transport": update.transport, "tensors": update.tensors,
                "bytes": update.nbytes, "seconds": time.perf_counter() - update.started}

    async def abort_weight_update(self) -> None:
        """Close an open weight update without publishing its version and resume generation (a no-op when
        none is open).  Layers that got all their tensors keep the new values: run the update again."""
        update = self._update
        if update is None:
            return
        if update.transport == "direct":  # put back the layers that were not touched yet
            with contextlib.suppress(Exception):
                await self.engine.collective_rpc("agentloop_finish_weight_update")
        await self._abandon_update()

    async def update_weights(self, named_tensors: Weights, global_steps: int | None = None, *,
                             transport: str = "auto") -> dict[str, Any]:
        """The whole update in one call (one bucket): begin, load, finish.  With tied embeddings and no
        ``lm_head.weight`` given, the output layer is loaded from ``model.embed_tokens.weight``."""
        await self.begin_weight_update(global_steps, transport=transport)
        for bucket in iter_buckets(named_tensors, bucket_bytes=1 << 62):
            await self.load_weight_bucket(bucket)
        return await self.finish_weight_update()

    async def _load_direct(self, bucket: WeightBucket, aliases: dict[str, str]) -> None:
        """Through a shared-memory segment, or inside the RPC message where none can be made."""
        shared = SharedBucket.create(bucket)
        if shared is None:
            await self.engine.collective_rpc("agentloop_load_weights", args=(bucket.to_wire(), aliases))
            return
        try:
            await self.engine.collective_rpc("agentloop_load_shared",
                                             args=(shared.path, shared.size, shared.layout, aliases))
        finally:
            shared.close()

    def _require_update(self, method: str) -> OpenWeightUpdate:
        if self._update is None:
            raise ServerError(f"vLLM server {self.server_index}: {method}() without an open weight update; "
                              "call begin_weight_update() first")
        return self._update

    async def _reload_from(self, path: str) -> None:
        if self.weight_transport == "direct":  # our extension is there: quiet, and the model path is kept
            await self.engine.collective_rpc("agentloop_reload_weights_from", args=(path,))
        else:
            await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": path,
                                                                       "is_checkpoint_format": True})

    async def _abandon_update(self) -> None:
        """Close the open update (whatever state it is in) and let generation go on."""
        update, self._update = self._update, None
        if update is not None and update.tmpdir is not None:
            update.tmpdir.cleanup()
        if not self._gate.paused:  # paused: the engine stays paused until resume()
            try:
                await self.engine.resume_generation()
            except Exception:
                if not self._engine_dead():  # a dead engine cannot resume: the caller reports that instead
                    raise
