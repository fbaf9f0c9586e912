"""Helpers behind :mod:`agentloop.batch.protocol` that need no DataProto: errors, auto-padding
config, unions, meta_info merging, equality, tensor (de)serialization and TensorDict conversion.

Everything here is re-exported from :mod:`agentloop.batch.protocol`, with the names verl's
``verl.protocol`` uses (``union_tensor_dict``, ``union_numpy_dict``, ``serialize_tensordict``,
``DataProtoConfig``
...).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, ClassVar, cast

import numpy as np
import tensordict
import torch
from packaging.version import parse as parse_version
from tensordict import TensorDict
from tensordict.tensorclass import NonTensorData, NonTensorStack

from agentloop.errors import DatasetError


class DataProtoError(DatasetError, AssertionError):
    """A DataProto operation got inconsistent input (mismatched sizes, conflicting values, bad
    keys).

    Also an ``AssertionError``: verl raises ``AssertionError`` in these places, so code written
    against verl (``except AssertionError`` / ``pytest.raises(AssertionError)``) keeps working.
    """


class DataProtoTypeError(DatasetError, TypeError):
    """A DataProto operation got an argument of an unsupported type (also a ``TypeError``, as in
    verl)."""


# ---- auto padding
# ---------------------------------------------------------------------------------
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


# ---- equality
# -------------------------------------------------------------------------------------
def deep_equal(a: Any, b: Any, _seen: set[int] | None = None) -> bool:
    """Strict structural equality: same types, NaN equals NaN, numpy arrays compared by dtype, shape
    and every element (object arrays recursively), tensors exactly, and self-referencing containers
    terminate (a cycle met again on the same path counts as equal)."""
    if type(a) is not type(b):
        return False
    seen = set() if _seen is None else _seen
    if id(a) in seen:
        return True
    seen.add(id(a))
    try:
        if isinstance(a, float):
            return a == b or (math.isnan(a) and math.isnan(b))
        if isinstance(a, np.ndarray):
            if a.dtype != b.dtype or a.shape != b.shape:
                return False
            if a.dtype != object:
                return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
            return all(deep_equal(x, y, seen) for x, y in zip(a.flat, b.flat, strict=True))
        if isinstance(a, torch.Tensor):
            return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(
                deep_equal(x, y, seen) for x, y in zip(a, b, strict=True)
            )
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(deep_equal(a[k], b[k], seen) for k in a)
        try:
            return bool(a == b)
        except (ValueError, TypeError, RuntimeError):
            return False
    finally:
        seen.discard(id(a))


def values_equal(a: Any, b: Any) -> bool:
    """``a == b`` (so ``1 == 1.0`` as in verl), falling back to :func:`deep_equal` for arrays and
    tensors."""
    try:
        return bool(a == b)
    except (ValueError, TypeError, RuntimeError):
        return deep_equal(a, b)


def tensors_equal(a: Any, b: Any) -> bool:
    """Exact equality of two tensors (or nested TensorDicts)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a.shape == b.shape and (a == b).all())


# ---- unions
# ---------------------------------------------------------------------------------------
def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add ``tensor_dict2``'s keys to ``tensor_dict1`` (in place) and return it; shared keys must
    be equal."""
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise DataProtoError(
            f"union_tensor_dict: the two tensor dicts must have identical batch size, got "
            f"{list(tensor_dict1.batch_size)} and {list(tensor_dict2.batch_size)}; select "
            f"the same rows on both sides"
        )
    existing = set(tensor_dict1.keys())  # ``key in td`` is not a key lookup on a TensorDict
    for key in tensor_dict2.keys():  # noqa: SIM118 - iterating a TensorDict yields rows, not keys
        if key not in existing:
            tensor_dict1[key] = tensor_dict2[key]
        elif not tensors_equal(tensor_dict1[key], tensor_dict2[key]):
            raise DataProtoError(
                f"union: tensor {key!r} holds different values in the two batches ({key} in "
                f"tensor_dict1 and "
                f"tensor_dict2 are not the same object); pop or rename it on one side "
                f"before the union"
            )
    return tensor_dict1


def union_numpy_dict(
    tensor_dict1: dict[str, np.ndarray], tensor_dict2: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Add ``tensor_dict2``'s arrays to ``tensor_dict1`` (in place) and return it; shared keys must
    hold deeply equal arrays (NaN equals NaN, object arrays compared element by element)."""
    for key, val in tensor_dict2.items():
        if key in tensor_dict1:
            for side, arr in (("tensor_dict1", tensor_dict1[key]), ("tensor_dict2", val)):
                if not isinstance(arr, np.ndarray):
                    raise DataProtoError(
                        f"union_numpy_dict: `{key}` in {side} must be a "
                        f"numpy array, got "
                        f"{type(arr).__name__}"
                    )
            if not deep_equal(tensor_dict1[key], val):
                raise DataProtoError(
                    f"union: `{key}` in tensor_dict1 and tensor_dict2 are not the same "
                    f"object. The non-tensor "
                    f"column holds different values on the two sides; pop or rename it on "
                    f"one side first"
                )
        tensor_dict1[key] = val
    return tensor_dict1


def union_two_dict(dict1: dict[str, Any], dict2: dict[str, Any]) -> dict[str, Any]:
    """Add ``dict2``'s items to ``dict1`` (in place) and return it; shared keys must hold equal
    values."""
    for key, val in dict2.items():
        if key in dict1 and not values_equal(dict1[key], val):
            raise DataProtoError(
                f"union: meta_info {key!r} differs ({dict1[key]!r} vs {val!r}); {key} in "
                f"meta_dict1 and "
                f"meta_dict2 are not the same object; pop it from one side before the union"
            )
        dict1[key] = val
    return dict1


# ---- meta_info merging (concat)
# -------------------------------------------------------------------
def list_of_dict_to_dict_of_list(list_of_dict: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """``[{"a": 1}, {"a": 2}]`` -> ``{"a": [1, 2]}``; the first dict names the keys every other
    may use."""
    if not list_of_dict:
        return {}
    out: dict[str, list[Any]] = {key: [] for key in list_of_dict[0]}
    for i, entry in enumerate(list_of_dict):
        if not isinstance(entry, dict):
            raise DataProtoError(
                f"expected a list of dicts, but entry {i} is a {type(entry).__name__}: {entry!r}"
            )
        for key, item in entry.items():
            if key not in out:
                raise DataProtoError(
                    f"key {key!r} of entry {i} is not present in the keys of the first "
                    f"dictionary in the list "
                    f"({sorted(out)}); give every dict the same keys"
                )
            out[key].append(item)
    return out


def merge_meta_info(metas: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """verl's concat rule: every part's keys are kept; a key present in several parts must hold
    equal values; ``metrics`` from all parts (a list extends, anything else is one entry, None is
    skipped) are flattened from a list of dicts into a dict of lists."""
    merged: dict[str, Any] = {}
    first_seen: dict[str, int] = {}
    metrics: list[Any] = []
    for i, meta in enumerate(metas):
        for key, value in meta.items():
            if key == "metrics":
                if isinstance(value, list):
                    metrics.extend(value)
                elif value is not None:
                    metrics.append(value)
            elif key not in merged:
                merged[key], first_seen[key] = value, i
            elif not values_equal(merged[key], value):
                raise DataProtoError(
                    f"Conflicting values for meta_info key {key!r}: part {first_seen[key]} "
                    f"has {merged[key]!r}, "
                    f"part {i} has {value!r}. Parts being concatenated must agree on every "
                    f"meta_info key except "
                    f"'metrics'; pop per-part values (e.g. timings) from each part before concat"
                )
    if metrics:
        if not all(isinstance(m, dict) for m in metrics):
            raise DataProtoError(
                "concat: meta_info['metrics'] must be a dict or a list of dicts in every "
                "part, got entries of "
                f"type {sorted({type(m).__name__ for m in metrics})}"
            )
        merged["metrics"] = list_of_dict_to_dict_of_list(metrics)
    return merged


# ---- row helpers
# ----------------------------------------------------------------------------------
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


# ---- compact pickling (DataProto.__getstate__)
# ----------------------------------------------------
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
        lo, hi = int(t.min()), int(t.max())
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


# ---- TensorDict with non-tensor data (verl's tensordict_utils.get_tensordict)
# ---------------------
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
