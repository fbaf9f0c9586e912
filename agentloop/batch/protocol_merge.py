"""Equality and merging of a DataProto's parts: strict deep equality, the ``union_*`` functions
(verl's names) and the ``concat`` rule for ``meta_info`` (``merge_meta_info``).

Re-exported from :mod:`agentloop.batch.protocol_utils` and :mod:`agentloop.batch.protocol`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from agentloop.batch.protocol_errors import DataProtoError

__all__ = [
    "deep_equal", "list_of_dict_to_dict_of_list", "merge_meta_info", "tensors_equal",
    "union_numpy_dict", "union_tensor_dict", "union_two_dict", "values_equal",
]


# ---- equality ------------------------------------------------------------------------------------
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


# ---- unions --------------------------------------------------------------------------------------
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


# ---- meta_info merging (concat) ------------------------------------------------------------------
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
