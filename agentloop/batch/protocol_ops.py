"""Module-level DataProto operations (verl's ``verl.protocol`` functions), re-exported from
:mod:`agentloop.batch.protocol`.

They only use a DataProto's rows and methods (:class:`DataProtoLike`) and ``type(data)``, so this
module never imports :mod:`agentloop.batch.protocol`, which imports it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeVar, cast

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict

from agentloop.batch.protocol_utils import DataProtoError


class DataProtoLike(Protocol):
    """What these operations use of a :class:`~agentloop.batch.protocol.DataProto`."""

    batch: TensorDict | None
    non_tensor_batch: dict[str, Any]
    meta_info: dict[str, Any]

    def __init__(
        self, batch: TensorDict | None = None, non_tensor_batch: dict[str, Any] | None = None,
        meta_info: dict[str, Any] | None = None,
    ) -> None: ...

    def __len__(self) -> int: ...

    def slice(
        self, start: int | None = None, end: int | None = None, step: int | None = None
    ) -> Any: ...

    def select_idxs(self, idxs: Any) -> Any: ...


DataProtoT = TypeVar("DataProtoT", bound=DataProtoLike)
"""A DataProto (of whatever DataProto class the caller has): each operation returns the class it
got."""


def pad_dataproto_to_divisor(data: DataProtoT, size_divisor: int) -> tuple[DataProtoT, int]:
    """Pad ``data`` to a multiple of ``size_divisor`` by appending its own rows again from the start
    (cycling when the padding is longer than the data); returns ``(padded, pad_size)``.  meta_info
    is kept."""
    if size_divisor < 1:
        raise DataProtoError(
            f"pad_dataproto_to_divisor: size_divisor must be >= 1, got {size_divisor}"
        )
    pad_size = (-len(data)) % size_divisor
    if not pad_size:
        return data, 0
    if len(data) == 0:
        raise DataProtoError(
            f"pad_dataproto_to_divisor: cannot pad an empty DataProto to a "
            f"multiple of {size_divisor}"
        )
    idx = np.concatenate([np.arange(len(data)), np.arange(pad_size) % len(data)])
    return data.select_idxs(idx), pad_size


def unpad_dataproto(data: DataProtoT, pad_size: int) -> DataProtoT:
    """Drop the last ``pad_size`` rows added by :func:`pad_dataproto_to_divisor`."""
    return data.slice(0, len(data) - pad_size) if pad_size else data


def split_rows(data: DataProtoT, n: int) -> list[DataProtoT]:
    """Split into exactly ``n`` consecutive parts whose sizes differ by at most one (larger parts
    first).

    Use this where ``len(data)`` need not be divisible by ``n`` (e.g. spreading prompts over
    workers); ``DataProto.chunk`` follows verl and requires divisibility unless auto padding is on.
    """
    if n < 1:
        raise DataProtoError(f"split_rows: n must be >= 1, got {n}")
    base, extra = divmod(len(data), n)
    bounds = np.cumsum([0] + [base + (i < extra) for i in range(n)])
    return [data.slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def fold_batch_dim(data: DataProtoT, new_batch_size: int) -> DataProtoT:
    """Fold ``[bsz, ...]`` into ``[new_batch_size, bsz // new_batch_size, ...]`` (tensors and
    non-tensor columns alike); the inverse is :func:`unfold_batch_dim`."""
    n = len(data)
    if new_batch_size < 1 or n % new_batch_size:
        raise DataProtoError(
            f"fold_batch_dim: batch size {n} is not divisible by new_batch_size={new_batch_size}"
        )
    batch = None
    if data.batch is not None:
        folded = {k: v.reshape(new_batch_size, -1, *v.shape[1:]) for k, v in data.batch.items()}
        batch = TensorDict(folded, batch_size=[new_batch_size], device=data.batch.device)
    non = {
        k: np.reshape(v, (new_batch_size, -1, *v.shape[1:]))
        for k, v in data.non_tensor_batch.items()
    }
    return type(data)(batch=batch, non_tensor_batch=non, meta_info=data.meta_info)


def unfold_batch_dim(data: DataProtoT, batch_dims: int = 2) -> DataProtoT:
    """Merge the first ``batch_dims`` dims of every tensor and non-tensor column into one batch
    dim."""
    shapes = [
        tuple(v.shape[:batch_dims]) for v in (data.batch.values() if data.batch is not None else [])
    ]
    shapes += [v.shape[:batch_dims] for v in data.non_tensor_batch.values()]
    if not shapes:
        return type(data)(batch=data.batch, non_tensor_batch={}, meta_info=data.meta_info)
    if len(set(shapes)) != 1 or len(shapes[0]) != batch_dims:
        raise DataProtoError(
            f"unfold_batch_dim: the first {batch_dims} dims differ between "
            f"columns "
            f"({sorted(set(shapes))}); every column must share them"
        )
    rows = math.prod(shapes[0])
    batch = None
    if data.batch is not None:
        flat = {k: v.reshape(rows, *v.shape[batch_dims:]) for k, v in data.batch.items()}
        batch = TensorDict(flat, batch_size=[rows], device=data.batch.device)
    non = {
        k: np.reshape(v, (rows, *v.shape[batch_dims:])) for k, v in data.non_tensor_batch.items()
    }
    return type(data)(batch=batch, non_tensor_batch=non, meta_info=data.meta_info)


def _concat_parts(parts: list[Any]) -> Any:
    """``concat`` of a list of DataProtos (of whatever DataProto class they are)."""
    return type(parts[0]).concat(parts)


def _pick_chunk(data: Any, i: int, chunks: int) -> Any:
    return data.chunk(chunks=chunks)[i]


@dataclass
class DataProtoFuture:
    """A DataProto that is still being computed by remote workers (a list of Ray object refs).

    The driver can pass it on to another worker group without fetching the data: ``collect_fn``
    merges the fetched parts and ``dispatch_fn`` (set by :meth:`chunk`) picks this receiver's share.
    """

    collect_fn: Callable[[list[Any]], Any]
    futures: list[Any]
    dispatch_fn: Callable[[Any], Any] | None = None

    @staticmethod
    def concat(data: list[Any]) -> DataProtoFuture:
        """A future for the row-wise concatenation of the refs in ``data``."""
        return DataProtoFuture(collect_fn=_concat_parts, futures=data)

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        """``chunks`` futures, the i-th resolving to ``self.get().chunk(chunks)[i]``."""
        return [
            DataProtoFuture(collect_fn=self.collect_fn, futures=self.futures,
                            dispatch_fn=partial(_pick_chunk, i=i, chunks=chunks))
            for i in range(chunks)
        ]

    def get(self) -> Any:
        """Fetch the parts (``ray.get``), merge them and apply ``dispatch_fn``."""
        import ray  # heavy (~0.6 s): loaded only when a future is fetched

        parts = ray.get(self.futures)
        if all(isinstance(p, TensorDict) for p in parts):
            output: Any = torch.cat(parts, dim=0)
        elif all(hasattr(type(p), "concat") and hasattr(p, "non_tensor_batch") for p in parts):
            output = self.collect_fn(parts)
        else:
            kinds = sorted({type(p).__name__ for p in parts})
            raise DataProtoError(
                f"DataProtoFuture.get: the futures resolved to {kinds}; "
                f"expected DataProtos or "
                "TensorDicts only"
            )
        return output if self.dispatch_fn is None else self.dispatch_fn(output)


def all_gather_data_proto(data: DataProtoLike, process_group: Any = None) -> None:
    """In place, like ``torch.distributed.all_gather``: every rank ends with all ranks' rows, in
    rank order.

    Tensors travel with ``all_gather`` (moved to the current CUDA device for an NCCL group and
    back), non-tensor columns with ``all_gather_object``.  Every rank must hold the same keys and
    row count.
    """
    world = dist.get_world_size(group=process_group)
    if data.batch is not None:
        device = data.batch.device
        wire = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(process_group) == "nccl"
            else None
        )
        gathered: dict[str, torch.Tensor] = {}
        for key, item in data.batch.items():
            value = cast(torch.Tensor, item)
            local = (value.to(wire) if wire is not None else value).contiguous()
            out = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(out, local, group=process_group)
            gathered[key] = torch.cat(out, dim=0).to(value.device)
        data.batch = TensorDict(gathered, batch_size=[len(data) * world], device=device)
    columns: list[Any] = [None] * world
    dist.all_gather_object(columns, data.non_tensor_batch, group=process_group)
    data.non_tensor_batch = {
        k: np.concatenate([c[k] for c in columns]) for k in data.non_tensor_batch
    }
