"""Streaming new policy weights into the rollout servers, bucket by bucket.

Driver side: :func:`iter_buckets` cuts a state dict or any iterable of ``(name, tensor)`` pairs into
:class:`WeightBucket` s of about ``bucket_bytes`` each, in order (a larger tensor travels alone; a
tensor is never split). Server protocol (every :class:`~agentloop.servers.base.LLMServer`)::

    begin_weight_update(global_steps)   # pause new requests, open the update
    load_weight_bucket(bucket)          # any number of times, any order
    finish_weight_update()              # apply, reset the prefix cache, publish the version, resume

Engine side for vLLM: :class:`VLLMWeightSyncExtension` (vLLM's ``worker_extension_cls``, qualified
name :data:`WORKER_EXTENSION`) feeds every bucket to vLLM's layerwise reload; a bucket reaches the
worker through a :class:`SharedBucket` (a ``/dev/shm`` segment; ``create`` returns None where none
can be made) or, failing that, inside the engine's RPC message (:meth:`WeightBucket.to_wire`).

Spec: docs/concepts.md#weight-sync; measurements: docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import tempfile
import uuid
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

WORKER_EXTENSION = "agentloop.servers.weight_sync.VLLMWeightSyncExtension"
"""The qualified name given to vLLM as ``worker_extension_cls``."""

EMBED_NAME, LM_HEAD_NAME = "model.embed_tokens.weight", "lm_head.weight"

_WIRE_CHUNK = 1 << 30  # msgpack bin objects stop at 4 GiB: larger tensors travel as several pieces

Weights = Mapping[str, Any] | Iterable[tuple[str, Any]]
"""A state dict (HF names → tensors) or an iterable of ``(name, tensor)`` pairs."""


@dataclass
class WeightBucket:
    """Named tensors as raw bytes: ``data[i]`` is the contiguous uint8 image of tensor ``names[i]``
    (torch dtype name ``dtypes[i]``, shape ``shapes[i]``)."""

    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    data: list[np.ndarray] = field(default_factory=list)

    def add(self, name: str, tensor: Any) -> None:
        """Append ``tensor`` (any device and dtype; detached, made contiguous, moved to CPU)."""
        # heavy: imported where tensors are packed, not by every user of the server protocol
        import torch

        t = tensor.detach().to("cpu").contiguous()
        self.names.append(str(name))
        self.dtypes.append(str(t.dtype).removeprefix("torch."))
        self.shapes.append(tuple(int(s) for s in t.shape))
        flat = t.reshape(-1)
        self.data.append(
            flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, dtype=np.uint8)
        )

    def __len__(self) -> int:
        return len(self.names)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in the bucket."""
        return sum(int(d.nbytes) for d in self.data)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` pairs viewing the bucket's bytes (no copy: treat them as
        read-only)."""
        for name, dtype, shape, data in zip(
            self.names, self.dtypes, self.shapes, self.data, strict=True
        ):
            yield name, tensor_view(data, dtype, shape)

    def to_wire(self) -> list[tuple[str, str, list[int], list[memoryview]]]:
        """The bucket as msgpack-friendly tuples ``(name, dtype, shape, [byte pieces])`` for the
        engine RPC (memoryviews over the bucket's arrays: encoded as msgpack bin, without an
        intermediate copy)."""
        wire = []
        for name, dtype, shape, data in zip(
            self.names, self.dtypes, self.shapes, self.data, strict=True
        ):
            raw = data.data.cast("B")
            pieces = [raw[k:k + _WIRE_CHUNK] for k in range(0, len(raw), _WIRE_CHUNK)] or [raw]
            wire.append((name, dtype, list(shape), pieces))
        return wire


Layout = list[tuple[str, str, list[int], int, int]]
"""Per tensor: name, dtype, shape, byte offset, byte size."""


class SharedBucket:
    """A bucket's bytes in one POSIX shared-memory segment, for engine workers on this machine.

    ``SharedBucket.create(bucket)`` returns None where no segment can be made; ``close()`` unlinks
    it.
    """

    SHM_DIR = "/dev/shm"

    def __init__(self, path: str, size: int, layout: Layout) -> None:
        self.path, self.size, self.layout = path, size, layout

    @classmethod
    def create(cls, bucket: WeightBucket) -> SharedBucket | None:
        size = max(1, bucket.nbytes)
        path = os.path.join(cls.SHM_DIR, f"agentloop-weights-{uuid.uuid4().hex}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError:
            return None
        try:
            os.posix_fallocate(fd, 0, size)  # a full /dev/shm fails here, not as SIGBUS on a write
            segment = mmap.mmap(fd, size)
        except OSError:
            os.unlink(path)
            return None
        finally:
            os.close(fd)
        layout: Layout = []
        offset = 0
        with segment:
            for name, dtype, shape, data in zip(
                bucket.names, bucket.dtypes, bucket.shapes, bucket.data, strict=True
            ):
                segment[offset:offset + data.nbytes] = data.data.cast("B")
                layout.append((name, dtype, list(shape), offset, int(data.nbytes)))
                offset += int(data.nbytes)
        return cls(path, size, layout)

    def close(self) -> None:
        """Remove the name; mappings made before stay valid until dropped."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def shared_tensors(path: str, size: int, layout: Layout) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs viewing the :class:`SharedBucket` segment at ``path`` of ``size``
    bytes, as ``layout`` places them (read-only; each keeps the mapping alive).  Raises OSError if
    it cannot be mapped."""
    fd = os.open(path, os.O_RDONLY)
    try:
        segment = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    for name, dtype, shape, offset, nbytes in layout:
        yield (
            name,
            tensor_view(
                np.frombuffer(segment, dtype=np.uint8, count=nbytes, offset=offset), dtype, shape
            ),
        )


def tensor_view(data: Any, dtype: str, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
    """A tensor of ``dtype`` (a torch dtype's name) and ``shape`` over the bytes in ``data`` (uint8
    numpy array, bytes or memoryview), without a copy where the buffer allows (treat it as
    read-only)."""
    # heavy: imported where tensors are unpacked, not by every user of the server protocol
    import torch

    torch_dtype = getattr(torch, dtype)
    if not len(data):  # uint8 array / bytes / byte memoryview: its length is its size in bytes
        return torch.empty(tuple(shape), dtype=torch_dtype)
    # read-only buffers (object store, RPC message, mapping): only read
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        flat = (
            torch.from_numpy(data)
            if isinstance(data, np.ndarray)
            else torch.frombuffer(data, dtype=torch.uint8)
        )
    return flat.view(torch_dtype).view(tuple(shape))


def named_tensors(weights: Weights) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` pairs from a state dict or an iterable of pairs."""
    if isinstance(weights, Mapping):
        yield from weights.items()
    else:
        yield from weights


def iter_buckets(weights: Weights, bucket_bytes: int) -> Iterator[WeightBucket]:
    """Cut ``weights`` into buckets of at most ``bucket_bytes`` (a bigger tensor gets a bucket of
    its own), keeping the given order; reads the input lazily, so an iterator is never held whole.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
    bucket = WeightBucket()
    size = 0
    for name, tensor in named_tensors(weights):
        nbytes = int(tensor.numel()) * int(tensor.element_size())
        if len(bucket) and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = WeightBucket(), 0
        bucket.add(name, tensor)
        size += nbytes
    if len(bucket):
        yield bucket


def tied_aliases(bucket: WeightBucket, tie_word_embeddings: bool) -> dict[str, str]:
    """``{"lm_head.weight": "model.embed_tokens.weight"}`` when embeddings are tied and the bucket
    has the embeddings but no ``lm_head``: the engine keeps a separate (on CPU, repacked) output
    layer that only changes when ``lm_head.weight`` itself is loaded."""
    if tie_word_embeddings and EMBED_NAME in bucket.names and LM_HEAD_NAME not in bucket.names:
        return {LM_HEAD_NAME: EMBED_NAME}
    return {}


@contextlib.contextmanager
def quiet_vllm_logs(level: int = logging.ERROR) -> Iterator[None]:
    """Raise the ``vllm`` logger to ``level`` (errors still show) for the duration of a weight
    load."""
    logger = logging.getLogger("vllm")
    previous = logger.level
    logger.setLevel(max(previous, level))
    try:
        yield
    finally:
        logger.setLevel(previous)


class VLLMWeightSyncExtension:
    """Methods vLLM mixes into its engine worker (``worker_extension_cls``), called through
    ``collective_rpc("agentloop_...")``.  Runs in the engine's worker process, beside the model."""

    vllm_config: Any
    model_runner: Any

    def agentloop_begin_weight_update(self) -> None:
        """Open vLLM's layerwise reload: layers fill up as their tensors arrive."""
        # vLLM: runs inside the engine's worker process, where it is loaded
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with quiet_vllm_logs(), set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    def agentloop_load_shared(
        self, path: str, size: int, layout: Layout, aliases: dict[str, str]
    ) -> int:
        """Load one bucket from a :class:`SharedBucket` segment; each ``aliases`` entry
        ``new → source`` loads a tensor of the bucket under a second name too (the tied
        ``lm_head``).  Returns the tensors loaded."""
        return self._agentloop_load(shared_tensors(path, size, layout), aliases)

    def agentloop_load_weights(self, wire: list[tuple[str, str, list[int], list[bytes]]],
                               aliases: dict[str, str]) -> int:
        """Load one bucket sent inside the RPC message (:meth:`WeightBucket.to_wire`), as
        :meth:`agentloop_load_shared` does."""
        pairs = ((name, tensor_view(p[0] if len(p) == 1 else b"".join(p), dtype, shape))
                 for name, dtype, shape, p in wire)
        return self._agentloop_load(pairs, aliases)

    def _agentloop_load(self, pairs: Iterable[tuple[str, Any]], aliases: dict[str, str]) -> int:
        from vllm.config import set_current_vllm_config  # vLLM: inside the engine's worker process

        loaded: dict[str, Any] = {}

        def with_aliases() -> Iterator[tuple[str, Any]]:
            for name, tensor in pairs:
                loaded[name] = tensor
                yield name, tensor
            for alias, source in aliases.items():
                yield alias, loaded[source]

        with quiet_vllm_logs(), set_current_vllm_config(self.vllm_config):
            self.model_runner.get_model().load_weights(with_aliases())
        return len(loaded) + len(aliases)

    def agentloop_finish_weight_update(self) -> None:
        """Close the layerwise reload (layers that got nothing keep their weights) and drop caches
        that depend on the weights, as vLLM's own ``reload_weights`` does."""
        # vLLM: runs inside the engine's worker process, where it is loaded
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        runner = self.model_runner
        with quiet_vllm_logs(), set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(runner.get_model(), self.vllm_config.model_config)
            runner.reset_lora_state()
            runner.reset_encoder_cache()
            runner.reset_mm_cache()

    def agentloop_reload_weights_from(self, path: str) -> None:
        """The file fallback: reload from safetensors files in ``path``, quietly, without leaving
        the model config pointing at ``path`` (vLLM's ``reload_weights`` rewrites it)."""
        model_config, load_config = self.vllm_config.model_config, self.vllm_config.load_config
        saved = (
            model_config.model, model_config.model_weights, model_config.revision,
            load_config.use_tqdm_on_load,
        )
        load_config.use_tqdm_on_load = False
        try:
            with quiet_vllm_logs():
                self.reload_weights(weights_path=path, is_checkpoint_format=True)  # type: ignore[attr-defined]
        finally:
            model_config.model, model_config.model_weights, model_config.revision = saved[:3]
            load_config.use_tqdm_on_load = saved[3]


@dataclass
class OpenWeightUpdate:
    """An open weight update on one server."""

    version: int
    transport: str
    started: float
    tmpdir: tempfile.TemporaryDirectory[str] | None = None
    tensors: int = 0
    nbytes: int = 0
    shards: list[str] = field(default_factory=list)


def write_shard(bucket: WeightBucket, aliases: dict[str, str], update: OpenWeightUpdate) -> None:
    """File transport: the bucket becomes one safetensors shard of the update's directory."""
    from safetensors.torch import save_file  # heavy (torch): only the file transport needs it

    assert update.tmpdir is not None
    tensors = dict(bucket.tensors())
    for alias, source in aliases.items():
        tensors[alias] = tensors[source].clone()  # safetensors refuses two names for one storage
    name = f"model-{len(update.shards):05d}.safetensors"
    save_file(tensors, str(Path(update.tmpdir.name) / name))
    update.shards.append(name)
