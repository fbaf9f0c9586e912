"""Tensor encodings of a DataProto's batch: the compact pickling behind ``DataProto.__getstate__``
(``pack_tensor`` / ``unpack_tensor``) and verl's byte-level serialization of tensors and
TensorDicts (``serialize_tensordict`` / ``deserialize_tensordict``).

Re-exported from :mod:`agentloop.batch.protocol_utils` and :mod:`agentloop.batch.protocol`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
from tensordict import TensorDict

from agentloop.batch.protocol_errors import DataProtoError

__all__ = [
    "deserialize_single_tensor", "deserialize_tensordict", "pack_tensor", "packable",
    "serialize_single_tensor", "serialize_tensordict", "unpack_tensor",
]


# ---- compact pickling (DataProto.__getstate__) ---------------------------------------------------
_NARROW = (torch.int8, torch.int16, torch.int32)
_NUMPY_OF = {
    torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
    torch.uint8: np.uint8, torch.bool: np.bool_, torch.float16: np.float16,
    torch.float32: np.float32, torch.float64: np.float64,
}


def packable(value: Any) -> bool:
    """Whether :func:`pack_tensor` can carry ``value`` (a CPU tensor with a numpy dtype)."""
    return (
        isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dtype in _NUMPY_OF
    )


def pack_tensor(t: torch.Tensor) -> tuple[np.ndarray, torch.dtype]:
    """``(array, original dtype)``; integer tensors are narrowed when every value fits."""
    arr = t.detach().contiguous().numpy()
    if t.dtype in (torch.int16, torch.int32, torch.int64) and t.numel():
        # numpy's reductions, not torch's: torch runs them on its intra-op thread pool, whose
        # wake-up cost 30-50 ms per call on a loaded 2-core host (measured; issue 33)
        lo, hi = int(arr.min()), int(arr.max())
        for narrow in _NARROW:
            if narrow.itemsize >= t.dtype.itemsize:
                break
            info = torch.iinfo(narrow)
            if info.min <= lo and hi <= info.max:
                return arr.astype(_NUMPY_OF[narrow]), t.dtype
    return arr, t.dtype


def unpack_tensor(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`pack_tensor`; always a copy (arrays Ray hands over zero-copy are
    read-only)."""
    return torch.from_numpy(np.array(arr, dtype=_NUMPY_OF[dtype], copy=True))


# ---- byte-level tensor serialization (verl's numpy serialization format) -------------------------
def serialize_single_tensor(obj: torch.Tensor) -> tuple[str, tuple[int, ...], np.ndarray]:
    """``(dtype name, shape, raw bytes as a uint8 array)``; works for every dtype, bfloat16 and
    fp8 included."""
    raw = obj.detach().cpu().flatten().contiguous().view(torch.uint8).numpy()
    return str(obj.dtype).removeprefix("torch."), tuple(obj.shape), raw


def deserialize_single_tensor(arr: tuple[str, Sequence[int], Any]) -> torch.Tensor:
    """Inverse of :func:`serialize_single_tensor` (returns a fresh, writable tensor)."""
    dtype_name, shape, data = arr
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise DataProtoError(f"deserialize_single_tensor: {dtype_name!r} is not a torch dtype name")
    buffer = bytearray(data)
    if not buffer:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(tuple(shape))


def serialize_tensordict(
    batch: TensorDict,
) -> tuple[tuple[int, ...], str | None, dict[str, tuple[Any, ...]]]:
    """``(batch_size, device, {key: encoded})``: a plain tensor encodes as
    ``(dtype, shape, bytes)``, a nested tensor as ``(layout, [encoded component, ...])``."""
    items: dict[str, tuple[Any, ...]] = {}
    for key, item in batch.items():
        value = cast(torch.Tensor, item)
        if value.is_nested:
            parts = [serialize_single_tensor(t) for t in value.unbind()]
            items[key] = (str(value.layout).removeprefix("torch."), parts)
        else:
            items[key] = serialize_single_tensor(value)
    device = None if batch.device is None else str(batch.device)
    return tuple(batch.batch_size), device, items


def deserialize_tensordict(
    arr: tuple[Sequence[int], str | None, dict[str, tuple[Any, ...]]],
) -> TensorDict:
    """Inverse of :func:`serialize_tensordict`."""
    batch_size, device, items = arr
    decoded: dict[str, torch.Tensor] = {}
    for key, value in items.items():
        if len(value) == 3:
            decoded[key] = deserialize_single_tensor(value)  # type: ignore[arg-type]
        elif len(value) == 2:
            layout, parts = value
            decoded[key] = torch.nested.as_nested_tensor(
                [deserialize_single_tensor(p) for p in parts], layout=getattr(torch, layout)
            )
        else:
            raise DataProtoError(
                f"deserialize_tensordict: {key!r} is encoded with {len(value)} fields; expected 3 "
                "(dtype, shape, bytes) or 2 (layout, components) as written by serialize_tensordict"
            )
    return TensorDict(source=decoded, batch_size=list(batch_size), device=device)
