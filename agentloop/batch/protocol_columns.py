"""Column operations of :class:`~agentloop.batch.protocol.DataProto` (a mixin it inherits):
``select``, ``pop``, ``rename`` and ``union`` pick, remove, rename and merge keys of ``batch``,
``non_tensor_batch`` and ``meta_info`` without changing the rows.

The methods use only what :class:`~agentloop.batch.protocol_ops.DataProtoLike` names, so this
module never imports :mod:`agentloop.batch.protocol`, which imports it.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
from tensordict import TensorDict

from agentloop.batch.protocol_errors import DataProtoError, DataProtoTypeError
from agentloop.batch.protocol_merge import union_numpy_dict, union_tensor_dict, union_two_dict
from agentloop.batch.protocol_ops import DataProtoLike, DataProtoT
from agentloop.errors import DatasetError

__all__ = ["DataProtoColumnsMixin"]


class DataProtoColumnsMixin:
    """``select`` / ``pop`` / ``rename`` / ``union`` of a DataProto class (which inherits them)."""

    # the DataProto dataclass's fields (declared here for the type checker only)
    batch: TensorDict | None
    non_tensor_batch: dict[str, np.ndarray]
    meta_info: dict[str, Any]

    # ---- key selection ------------------------------------------------------------------------
    def select(
        self: DataProtoT, batch_keys: list[str] | None = None,
        non_tensor_batch_keys: list[str] | None = None, meta_info_keys: list[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProtoT:
        """A DataProto with only the named keys (None keeps all of that kind)."""
        batch = self.batch
        if batch is not None and batch_keys is not None:
            batch = batch.select(*batch_keys)
        non = self.non_tensor_batch
        if non_tensor_batch_keys is not None:
            non = {k: v for k, v in non.items() if k in non_tensor_batch_keys}
        meta = self.meta_info
        if meta_info_keys is not None:
            meta = {k: v for k, v in meta.items() if k in meta_info_keys}
        out = type(self)(batch=batch, non_tensor_batch=dict(non), meta_info=dict(meta))
        return copy.deepcopy(out) if deepcopy else out

    def pop(
        self: DataProtoT, batch_keys: list[str] | None = None,
        non_tensor_batch_keys: list[str] | None = None, meta_info_keys: list[str] | None = None,
    ) -> DataProtoT:
        """Remove the named keys from self and return them as a new DataProto."""
        present = set() if self.batch is None else set(self.batch.keys())
        for kind, keys, have in (
            ("batch_keys", batch_keys, present),
            ("non_tensor_batch_keys", non_tensor_batch_keys, set(self.non_tensor_batch)),
            ("meta_info_keys", meta_info_keys, set(self.meta_info)),
        ):
            missing = sorted(set(keys or []) - have)
            if missing:
                raise DataProtoError(
                    f"pop: {kind} {missing} are not in this DataProto (it has {sorted(have)})"
                )
        tensors = {k: self.batch.pop(k) for k in batch_keys or []} if self.batch is not None else {}
        non = {k: self.non_tensor_batch.pop(k) for k in non_tensor_batch_keys or []}
        meta = {k: self.meta_info.pop(k) for k in meta_info_keys or []}
        batch = (
            TensorDict(tensors, batch_size=self.batch.batch_size)
            if tensors and self.batch is not None
            else None
        )
        return type(self)(batch=batch, non_tensor_batch=non, meta_info=meta)

    def rename(
        self: DataProtoT, old_keys: str | list[str] | None = None,
        new_keys: str | list[str] | None = None,
    ) -> DataProtoT:
        """Rename tensor (``batch``) keys in place; returns self."""
        names: list[list[str]] = []
        for arg, keys in (("old_keys", old_keys), ("new_keys", new_keys)):
            if not isinstance(keys, (str, list)):
                raise DataProtoTypeError(
                    f"rename: {arg} must be a list or a string, but got {type(keys).__name__}"
                )
            names.append([keys] if isinstance(keys, str) else list(keys))
        old, new = names
        if len(old) != len(new):
            raise DatasetError(
                f"rename: new_keys and old_keys must have the same length, "
                f"but got {len(new)} and "
                f"{len(old)}"
            )
        if old and self.batch is None:
            raise DataProtoError(f"rename: this DataProto has no tensor batch to rename {old} in")
        for o, n in zip(old, new, strict=True):
            self.batch.rename_key_(o, n)  # type: ignore[union-attr]
        return self

    def union(self: DataProtoT, other: DataProtoLike) -> DataProtoT:
        """Merge ``other``'s keys into self (in place); shared keys must hold equal values."""
        if len(self) != len(other) and len(self) and len(other):
            raise DataProtoError(f"union: batch sizes differ ({len(self)} vs {len(other)})")
        if other.batch is not None:
            self.batch = (
                other.batch if self.batch is None else union_tensor_dict(self.batch, other.batch)
            )
        self.non_tensor_batch = union_numpy_dict(self.non_tensor_batch, other.non_tensor_batch)
        self.meta_info = union_two_dict(self.meta_info, other.meta_info)
        return self
