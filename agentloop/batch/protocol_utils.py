"""Helpers behind :mod:`agentloop.batch.protocol` that need no DataProto: the auto-padding config,
row helpers (object columns, indices, key checks, ``get_data_info``) and TensorDict conversion.

It also re-exports the helpers split out of it, so every name it had still imports from here: the
errors (:mod:`~agentloop.batch.protocol_errors`), equality, unions and meta_info merging
(:mod:`~agentloop.batch.protocol_merge`) and tensor (de)serialization
(:mod:`~agentloop.batch.protocol_codec`).  Everything here is re-exported from
:mod:`agentloop.batch.protocol`, with the names verl's ``verl.protocol`` uses
(``union_tensor_dict``, ``union_numpy_dict``, ``serialize_tensordict``, ``DataProtoConfig`` ...).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, ClassVar, cast

import numpy as np
import tensordict
import torch
from packaging.version import parse as parse_version
from tensordict import TensorDict
from tensordict.tensorclass import NonTensorData, NonTensorStack

from agentloop.batch.protocol_codec import (
    deserialize_single_tensor,
    deserialize_tensordict,
    pack_tensor,
    packable,
    serialize_single_tensor,
    serialize_tensordict,
    unpack_tensor,
)
from agentloop.batch.protocol_errors import DataProtoError, DataProtoTypeError
from agentloop.batch.protocol_merge import (
    deep_equal,
    list_of_dict_to_dict_of_list,
    merge_meta_info,
    tensors_equal,
    union_numpy_dict,
    union_tensor_dict,
    union_two_dict,
    values_equal,
)
from agentloop.errors import DatasetError

__all__ = [
    "DataProtoConfig", "DataProtoError", "DataProtoTypeError", "as_index_array", "check_same_keys",
    "data_info", "deep_equal", "deserialize_single_tensor", "deserialize_tensordict",
    "get_tensordict", "list_of_dict_to_dict_of_list", "merge_meta_info", "object_array",
    "pack_tensor", "packable", "parts_to_tensordict", "serialize_single_tensor",
    "serialize_tensordict", "stack_rows", "tensordict_to_parts", "tensors_equal", "type_info",
    "union_numpy_dict", "union_tensor_dict", "union_two_dict", "unpack_tensor", "values_equal",
]


# ---- auto padding --------------------------------------------------------------------------------
class _DataProtoConfigMeta(type):
    """Class-level ``DataProtoConfig.auto_padding`` property (verl's spelling)."""

    _config: ClassVar[dict[str, bool]] = {}
    auto_padding_key = "_verl_auto_padding"  # meta_info key; verl's name so batches interoperate

    @property
    def auto_padding(cls) -> bool:
        """True when ``VERL_AUTO_PADDING`` is ``1``/``true`` or it was switched on in code."""
        by_env = os.getenv("VERL_AUTO_PADDING", "FALSE").upper() in ("TRUE", "1")
        return by_env or cls._config.get(cls.auto_padding_key, False)

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise DataProtoError(
                f"DataProtoConfig.auto_padding must be True or False, got {enabled!r}"
            )
        cls._config[cls.auto_padding_key] = enabled


class DataProtoConfig(metaclass=_DataProtoConfigMeta):
    """Process-wide switch: ``DataProtoConfig.auto_padding = True`` lets ``chunk`` split uneven
    batches."""


# ---- row helpers ---------------------------------------------------------------------------------
def object_array(values: Sequence[Any]) -> np.ndarray:
    """A 1-D object array holding ``values`` as-is (lists and dicts stay single entries)."""
    arr = np.empty(len(values), dtype=object)
    arr[:] = list(values)
    return arr


def stack_rows(rows: Sequence[Any]) -> np.ndarray:
    """Rebuild a non-tensor column from its rows, in the layout it had: array rows are stacked (a
    2-D column stays 2-D), numpy scalars keep their dtype, anything else becomes a 1-D object array.
    """
    if rows and all(isinstance(r, np.ndarray) for r in rows) and len({r.shape for r in rows}) == 1:
        return np.stack(list(rows))
    if rows and all(isinstance(r, np.generic) for r in rows) and len({r.dtype for r in rows}) == 1:
        return np.array(list(rows))
    return object_array(rows)


def type_info(value: Any) -> str:
    """Short recursive type description used by ``DataProto.get_data_info`` (``list[int]``,
    ``dict[str: float]``)."""
    if isinstance(value, list):
        kinds = sorted({type_info(v) for v in value[:3]})
        return f"list[{'|'.join(kinds) if kinds else '...'}]"
    if isinstance(value, tuple):
        return f"tuple({', '.join(type_info(v) for v in value)})"
    if isinstance(value, dict):
        if not value:
            return "dict"
        k, v = next(iter(value.items()))
        return f"dict[{type_info(k)}: {type_info(v)}]"
    if isinstance(value, np.ndarray):
        return f"ndarray{value.shape} ({value.dtype})"
    return type(value).__name__


def data_info(
    batch: TensorDict | None, non_tensor_batch: dict[str, np.ndarray], meta_info: dict[str, Any]
) -> str:
    """``DataProto.get_data_info``: each tensor's shape, dtype and device, each column's shape and
    dtype, and the (recursive) type of each meta_info value, one per line under ``batch`` /
    ``non_tensor_batch`` / ``meta_info`` headers."""
    lines = ["batch"]
    for key, value in (batch.items() if batch is not None else []):
        device = f" {value.device}" if hasattr(value, "device") else ""
        lines.append(
            f"  {key}: {tuple(value.shape)} ({value.dtype}){device}"
            if hasattr(value, "dtype")
            else f"  {key}: {type(value).__name__}"
        )
    lines.append("non_tensor_batch")
    lines += [f"  {key}: ndarray{arr.shape} ({arr.dtype})" for key, arr in non_tensor_batch.items()]
    lines.append("meta_info")
    lines += [f"  {key}: {type_info(value)}" for key, value in meta_info.items()]
    return "\n".join(lines)


def as_index_array(idxs: Any) -> np.ndarray:
    """Integer row indices from a list, numpy array or tensor of ints or booleans (a mask)."""
    if isinstance(idxs, torch.Tensor):
        idxs = idxs.detach().cpu().numpy()
    idxs = np.asarray(idxs)
    if idxs.dtype == bool:
        return np.nonzero(idxs)[0]
    if idxs.size and idxs.dtype.kind not in "iu":
        raise DataProtoTypeError(
            f"row indices must be integers or booleans, got dtype {idxs.dtype}"
        )
    return idxs.astype(np.int64).reshape(-1)


def check_same_keys(parts: Sequence[Any]) -> None:
    """Raise :class:`DataProtoError` naming the keys that differ between ``parts[0]`` and another
    DataProto."""

    def keys(d: Any) -> tuple[frozenset[str] | None, frozenset[str]]:
        return (None if d.batch is None else frozenset(map(str, d.batch.keys()))), frozenset(
            d.non_tensor_batch
        )

    ref_t, ref_n = keys(parts[0])
    for i, d in enumerate(parts[1:], start=1):
        t, n = keys(d)
        if (t is None) != (ref_t is None):
            raise DataProtoError(f"concat: part 0 and part {i} disagree on having a tensor batch")
        diff = sorted((t or frozenset()) ^ (ref_t or frozenset())) + sorted(n ^ ref_n)
        if diff:
            raise DataProtoError(
                f"concat: part {i} does not have the same keys as part 0; differing keys: {diff}"
            )

# ---- TensorDict with non-tensor data (verl's tensordict_utils.get_tensordict) --------------------
def _require_tensordict_010(what: str) -> None:
    if parse_version(str(tensordict.__version__)) < parse_version("0.10"):
        raise DatasetError(f"{what} needs tensordict >= 0.10 (installed {tensordict.__version__}); "
                           "upgrade it with `pip install -U tensordict`")


def get_tensordict(
    tensor_dict: dict[str, Any], non_tensor_dict: dict[str, Any] | None = None
) -> TensorDict:
    """One TensorDict from per-row data and metadata.

    ``tensor_dict`` values are tensors (dim 0 is the batch), lists / numpy arrays (stored one entry
    per row as a ``NonTensorStack``, so nested lists and dicts survive), NonTensorStacks or nested
    TensorDicts; ``non_tensor_dict`` values are stored whole as ``NonTensorData`` (DataProto's
    meta_info).
    """
    _require_tensordict_010("get_tensordict")
    source: dict[str, Any] = {}
    batch_size: int | None = None
    first_key = ""
    for key, val in tensor_dict.items():
        if (
            isinstance(val, torch.Tensor)
            and val.is_nested
            and not (val.is_contiguous() and val.layout == torch.jagged)
        ):
            raise DataProtoError(
                f"get_tensordict: nested tensor {key!r} must be contiguous with layout=torch.jagged"
            )
        if isinstance(val, (list, np.ndarray)):
            if any(isinstance(v, torch.Tensor) for v in val):
                raise DataProtoError(
                    f"get_tensordict: list {key!r} holds tensors; a list "
                    f"becomes per-row "
                    "non-tensor data, so convert its entries to numpy first"
                )
            val = NonTensorStack.from_list(cast(Any, [NonTensorData(item) for item in val]))
        elif not isinstance(val, (torch.Tensor, TensorDict, NonTensorStack)):
            raise DataProtoError(
                f"get_tensordict: {key!r} -> {type(val).__name__} isn't a "
                f"tensor, list or numpy "
                "array; pass per-batch values through non_tensor_dict instead"
            )
        rows = len(val) if isinstance(val, NonTensorStack) else int(val.shape[0])
        if batch_size is None:
            batch_size, first_key = rows, key
        elif rows != batch_size:
            raise DataProtoError(
                f"get_tensordict: batch size of {key!r} is not consistent "
                f"with other tensors: "
                f"expected {batch_size} (from {first_key!r}), got {rows}"
            )
        source[key] = val
    for key, val in (non_tensor_dict or {}).items():
        if key in source:
            raise DataProtoError(
                f"get_tensordict: {key!r} is both a per-row column and a non-tensor entry"
            )
        source[key] = NonTensorData(val)
    return TensorDict(source=source, batch_size=[] if batch_size is None else [batch_size])


def parts_to_tensordict(batch: TensorDict | None, non_tensor_batch: dict[str, np.ndarray],
                        meta_info: dict[str, Any]) -> TensorDict:
    """The TensorDict form of a DataProto's three parts (see ``DataProto.to_tensordict``)."""
    _require_tensordict_010("DataProto.to_tensordict")
    columns: dict[str, Any] = {} if batch is None else dict(batch.items())
    common = sorted(set(columns) & set(non_tensor_batch))
    if common:
        raise DataProtoError(
            f"to_tensordict: keys {common} are in both batch and non_tensor_batch; rename one side"
        )
    for key, arr in non_tensor_batch.items():
        columns[key] = NonTensorStack.from_list(cast(Any, [NonTensorData(item) for item in arr]))
    return get_tensordict(columns, non_tensor_dict=meta_info)


def tensordict_to_parts(
    td: TensorDict, meta_info: dict[str, Any] | None, num_batch_dims: int
) -> tuple[TensorDict | None, dict[str, np.ndarray], dict[str, Any]]:
    """Split a TensorDict into (tensor batch, per-row numpy columns, meta_info) — the inverse of
    :func:`parts_to_tensordict`: tensors go to the batch, NonTensorStacks to rows, NonTensorData to
    meta."""
    _require_tensordict_010("DataProto.from_tensordict")
    if num_batch_dims < 1:
        raise DataProtoError(
            f"from_tensordict: num_batch_dims must be greater than zero, got {num_batch_dims}"
        )
    meta = dict(meta_info or {})
    tensors: dict[str, Any] = {}
    rows: dict[str, np.ndarray] = {}
    for key, val in td.items():
        if isinstance(val, NonTensorStack):
            rows[key] = stack_rows(val.tolist())
        elif isinstance(val, NonTensorData):
            meta[key] = val.data
        else:
            tensors[key] = val
    if rows and num_batch_dims != 1:
        raise DataProtoError(
            "from_tensordict: only num_batch_dims=1 is supported when the "
            "TensorDict holds "
            "non-tensor data"
        )
    if not tensors:
        return None, rows, meta
    dims = list(next(iter(tensors.values())).shape[:num_batch_dims])
    return TensorDict(tensors, batch_size=dims), rows, meta
