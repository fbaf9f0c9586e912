"""DataProto: the batch container passed between trainer, manager and workers.

Same attribute names and semantics as ``verl.protocol.DataProto`` (verl 0.9.1): ``batch`` is a
``tensordict.TensorDict`` (or None) with one batch dim, ``non_tensor_batch`` a dict of numpy arrays
(object dtype for ragged data) whose first dimension is the batch size, ``meta_info`` a free dict.
verl's module functions (``union_tensor_dict``, ``fold_batch_dim``, ``collate_fn``,
``DataProtoFuture``, ``DataProtoConfig`` ...) are importable from here too.  Where verl uses
``assert``, agentloop raises :class:`~agentloop.batch.protocol_utils.DataProtoError`, which is both
a ``DatasetError`` and an ``AssertionError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader

from agentloop.batch import protocol_wire
from agentloop.batch.protocol_columns import DataProtoColumnsMixin
from agentloop.batch.protocol_ops import (
    DataProtoFuture,
    all_gather_data_proto,
    fold_batch_dim,
    pad_dataproto_to_divisor,
    split_rows,
    unfold_batch_dim,
    unpad_dataproto,
)
from agentloop.batch.protocol_reshape import DataProtoReshapeMixin
from agentloop.batch.protocol_utils import (
    DataProtoConfig,
    DataProtoError,
    DataProtoTypeError,
    as_index_array,
    check_same_keys,  # noqa: F401 - re-exported (agentloop.protocol)
    data_info,
    deserialize_single_tensor,
    deserialize_tensordict,
    get_tensordict,
    list_of_dict_to_dict_of_list,
    merge_meta_info,  # noqa: F401 - re-exported (agentloop.protocol)
    object_array,
    pack_tensor,
    packable,
    parts_to_tensordict,
    serialize_single_tensor,
    serialize_tensordict,
    stack_rows,
    tensordict_to_parts,
    union_numpy_dict,
    union_tensor_dict,
    union_two_dict,  # noqa: F401 - re-exported (agentloop.protocol)
    unpack_tensor,
)
from agentloop.batch.protocol_wire import join_derived, split_derived, trim, untrim
from agentloop.errors import DatasetError

__all__ = [
    "DataProto", "DataProtoConfig", "DataProtoError", "DataProtoFuture", "DataProtoItem",
    "DataProtoTypeError", "all_gather_data_proto", "collate_fn", "deserialize_single_tensor",
    "deserialize_tensordict", "fold_batch_dim", "get_tensordict", "object_array",
    "pad_dataproto_to_divisor", "serialize_single_tensor", "serialize_tensordict", "split_rows",
    "unfold_batch_dim", "union_numpy_dict", "union_tensor_dict", "unpad_dataproto",
]


def _trimmed(
    packed: tuple[np.ndarray, torch.dtype], pads: tuple[Any, Any] | None = None
) -> tuple[Any, torch.dtype]:
    """A packed column without its padding runs (:func:`~agentloop.batch.protocol_wire.trim`)."""
    return trim(packed[0], pads), packed[1]


@dataclass
class DataProtoItem:
    """One row of a DataProto (what ``data[i]`` returns)."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataProto(DataProtoColumnsMixin, DataProtoReshapeMixin):
    """A batch: tensors (``batch``), per-row Python objects (``non_tensor_batch``) and
    ``meta_info``."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.non_tensor_batch = {} if self.non_tensor_batch is None else self.non_tensor_batch
        self.meta_info = {} if self.meta_info is None else self.meta_info
        self.check_consistency()

    def check_consistency(self) -> None:
        """Raise :class:`DataProtoError` unless ``batch`` is a TensorDict with exactly one batch dim
        (or None) and every non-tensor value is a numpy array with one row per batch row."""
        n = None
        if self.batch is not None:
            if not isinstance(self.batch, TensorDict) or len(self.batch.batch_size) != 1:
                got = (
                    list(self.batch.batch_size)
                    if isinstance(self.batch, TensorDict)
                    else type(self.batch).__name__
                )
                raise DataProtoError(
                    f"DataProto.batch must be a TensorDict with exactly "
                    f"one batch dim (only "
                    f"num_batch_dims=1 is supported) or None, got {got}"
                )
            n = int(self.batch.batch_size[0])
        for key, val in self.non_tensor_batch.items():
            if not isinstance(val, np.ndarray):
                raise DataProtoError(
                    f"non_tensor_batch[{key!r}] must be a numpy array "
                    f"(dtype=object for ragged "
                    f"data), got {type(val).__name__}; wrap it with "
                    f"agentloop.protocol.object_array"
                )
            if val.ndim == 0:
                raise DataProtoError(
                    f"non_tensor_batch[{key!r}] is a 0-d array; it needs one entry per row"
                )
            if n is None:
                n = len(val)
            elif len(val) != n:
                raise DataProtoError(
                    f"non_tensor_batch[{key!r}] has {len(val)} rows but the batch has {n}"
                )

    # ---- pickling (Ray transfers between workers and the driver) --------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """A compact, exact state: CPU integer tensors travel as numpy arrays of the narrowest
        integer type that holds their values (masks as int8, ids as int32) and are restored to their
        own dtype on load.  A 256 × 320 rollout batch shrinks from 2.8 MB to ~0.9 MB, which Ray
        moves ~3× faster (measured in scripts/bench_overhead.py); values and dtypes come back
        bit-identical.
        In verl's rollout layout, ``input_ids``, ``attention_mask`` and 2-D ``position_ids`` are
        left out when an exact check proves them rebuilt from ``prompts`` / ``responses`` and each
        row's span, and rebuilt on load; padded 2-D columns travel without their padding runs
        (:mod:`agentloop.batch.protocol_wire`). Only batches whose packed tensors reach
        :data:`~agentloop.batch.protocol_wire.SHRINK_ABOVE` bytes: below it the checks' fixed cost
        (~0.2 ms a pickle and load) outweighs the bytes saved.
        """
        return self.wire_state()

    def wire_state(
        self, shrink: bool | None = None, pads: dict[str, tuple[Any, Any]] | None = None
    ) -> dict[str, Any]:
        """What :meth:`__getstate__` returns; ``shrink`` True / False forces the derived columns'
        and padding runs' checks on or off (None: only from
        :data:`~agentloop.batch.protocol_wire.SHRINK_ABOVE` bytes), and ``pads`` (per column, the
        padding values another run's state chose) fixes those columns' padding values, so that
        runs of one group encoded apart take the same form (:mod:`agentloop.batch.wire_runs`)."""
        batch: Any = self.batch
        if batch is not None and all(packable(v) for v in batch.values()):
            tensors = dict(batch.items())
            packed: dict[str, Any] = {}  # with shrink forced, the columns left out are never packed
            if shrink is None:
                packed = {k: pack_tensor(v) for k, v in tensors.items()}
                shrink = sum(a.nbytes for a, _ in packed.values()) >= protocol_wire.SHRINK_ABOVE
            batch = {"batch_size": list(batch.batch_size)}
            if shrink:
                arrays = {k: v.detach().numpy() for k, v in tensors.items()}
                left_out, recipe = split_derived(arrays)
                pads = pads or {}
                batch["tensors"] = {
                    k: _trimmed(packed.get(k) or pack_tensor(v), pads.get(k))
                    for k, v in tensors.items() if k not in left_out
                }
                if left_out:
                    batch["derived"] = recipe
            else:
                batch["tensors"] = packed or {k: pack_tensor(v) for k, v in tensors.items()}
        return {
            "batch": batch, "non_tensor_batch": self.non_tensor_batch, "meta_info": self.meta_info,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        batch = state["batch"]
        if isinstance(batch, dict):
            tensors = {k: unpack_tensor(untrim(a), t) for k, (a, t) in batch["tensors"].items()}
            if "derived" in batch:
                cols = join_derived({k: v.numpy() for k, v in tensors.items()}, batch["derived"])
                tensors = {
                    k: tensors[k] if k in tensors else torch.from_numpy(v) for k, v in cols.items()
                }
            batch = TensorDict(tensors, batch_size=batch["batch_size"])
        self.batch = batch
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_dict(
        cls, tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None, meta_info: dict[str, Any] | None = None,
        num_batch_dims: int = 1, auto_padding: bool = False,
    ) -> DataProto:
        """Build from tensors (same leading dim) and per-row values.

        Non-array values become ``np.array(values, dtype=object)`` as in verl, so equal-length
        nested lists make a 2-D column; pass ``object_array(values)`` to keep exactly one list per
        row. ``auto_padding=True`` lets :meth:`chunk` split this batch unevenly.
        """
        if num_batch_dims < 1:
            raise DataProtoError(
                f"from_dict: num_batch_dims must be greater than zero, got {num_batch_dims}"
            )
        if non_tensors is not None and num_batch_dims != 1:
            raise DataProtoError(
                "from_dict: only num_batch_dims=1 is supported when non_tensors is given"
            )
        tensors = tensors or {}
        non = {
            k: v if isinstance(v, np.ndarray) else np.array(v, dtype=object)
            for k, v in (non_tensors or {}).items()
        }
        batch = None
        if tensors:
            first_key, first = next(iter(tensors.items()))
            dims = tuple(first.shape[:num_batch_dims])
            for key, val in tensors.items():
                if tuple(val.shape[:num_batch_dims]) != dims:
                    raise DataProtoError(
                        f"from_dict: not all the tensors have the same batch size with "
                        f"batch_dims={num_batch_dims}: "
                        f"{first_key!r} has {dims}, {key!r} has {tuple(val.shape[:num_batch_dims])}"
                    )
            batch = TensorDict(dict(tensors), batch_size=list(dims))
        meta = dict(meta_info or {})
        if auto_padding:
            meta[DataProtoConfig.auto_padding_key] = True
        return cls(batch=batch, non_tensor_batch=non, meta_info=meta)

    @classmethod
    def from_single_dict(
        cls, data: dict[str, Any], meta_info: dict[str, Any] | None = None,
        auto_padding: bool = False,
    ) -> DataProto:
        """Split one dict into tensors and numpy arrays."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        non = {k: v for k, v in data.items() if isinstance(v, np.ndarray)}
        other = set(data) - set(tensors) - set(non)
        if other:
            raise DatasetError(
                f"from_single_dict: values must be tensors or numpy arrays; "
                f"bad keys {sorted(other)}"
            )
        return cls.from_dict(tensors, non, meta_info, auto_padding=auto_padding)

    @classmethod
    def from_tensordict(
        cls, tensor_dict: TensorDict, meta_info: dict[str, Any] | None = None,
        num_batch_dims: int = 1,
    ) -> DataProto:
        """Inverse of :meth:`to_tensordict`: tensors -> ``batch``, NonTensorStacks ->
        ``non_tensor_batch``, NonTensorData -> ``meta_info`` (merged over ``meta_info``).  Needs
        tensordict >= 0.10."""
        batch, non, meta = tensordict_to_parts(tensor_dict, meta_info, num_batch_dims)
        return cls(batch=batch, non_tensor_batch=non, meta_info=meta)

    def to_tensordict(self) -> TensorDict:
        """One TensorDict: tensors as-is, each non-tensor column as a NonTensorStack (one entry per
        row, so nested lists and dicts survive) and each meta_info item as NonTensorData.  Needs
        tensordict >= 0.10."""
        return parts_to_tensordict(self.batch, self.non_tensor_batch, self.meta_info)

    # ---- size and indexing ----------------------------------------------------------------------
    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        if self.non_tensor_batch:
            return len(next(iter(self.non_tensor_batch.values())))
        return 0

    def __getitem__(self, item: Any) -> Any:
        """``data[i]`` -> :class:`DataProtoItem`; a slice, list, numpy array or tensor of indices
        (or a boolean mask) -> DataProto."""
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if (
            isinstance(item, (np.ndarray, torch.Tensor))
            and item.ndim == 0
            and "bool" not in str(item.dtype)
        ):
            item = int(item)  # a 0-d integer array / tensor is one index
        if isinstance(item, (list, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        if isinstance(item, (int, np.integer)):
            i = int(item)
            return DataProtoItem(
                batch=None if self.batch is None else self.batch[i],
                non_tensor_batch={k: v[i] for k, v in self.non_tensor_batch.items()},
                meta_info=self.meta_info,
            )
        raise DataProtoTypeError(
            f"Indexing with {type(item).__name__} is not supported; "
            f"use an int, a slice, "
            "or a list / numpy array / tensor of indices or booleans"
        )

    def slice(
        self, start: int | None = None, end: int | None = None, step: int | None = None
    ) -> DataProto:
        """Rows ``start:end:step``."""
        s = slice(start, end, step)
        return type(self)(
            batch=None if self.batch is None else self.batch[s],
            non_tensor_batch={k: v[s] for k, v in self.non_tensor_batch.items()},
            meta_info=dict(self.meta_info),
        )

    def select_idxs(self, idxs: Any) -> DataProto:
        """Rows at integer indices or a boolean mask (list, numpy array or tensor)."""
        idx = as_index_array(idxs)
        batch = None
        if self.batch is not None:
            batch = TensorDict({k: v[torch.from_numpy(idx)] for k, v in self.batch.items()},
                               batch_size=[len(idx)], device=self.batch.device)
        return type(self)(
            batch=batch, non_tensor_batch={k: v[idx] for k, v in self.non_tensor_batch.items()},
            meta_info=dict(self.meta_info),
        )

    def reorder(self, indices: Any) -> None:
        """Permute the rows in place (``indices``: tensor, numpy array or list); meta_info is
        untouched."""
        idx = as_index_array(indices)
        if self.batch is not None:
            self.batch = self.batch[torch.from_numpy(idx)]
        self.non_tensor_batch = {k: v[idx] for k, v in self.non_tensor_batch.items()}

    # ---- iteration ------------------------------------------------------------------------------
    def make_iterator(self, mini_batch_size: int, epochs: int, seed: int | None = None,
                      dataloader_kwargs: dict[str, Any] | None = None) -> Any:
        """Iterate over mini-batches (DataProtos carrying this meta_info) for ``epochs`` passes
        through a ``torch.utils.data.DataLoader``; ``seed`` fixes its shuffling
        (``dataloader_kwargs={"shuffle": True}``)."""
        if mini_batch_size < 1 or len(self) % mini_batch_size:
            raise DataProtoError(
                f"make_iterator: {len(self)} % {mini_batch_size} != 0; the "
                f"batch size must be a "
                "multiple of mini_batch_size"
            )
        if dataloader_kwargs is not None and not isinstance(dataloader_kwargs, dict):
            raise DataProtoTypeError(f"make_iterator: dataloader_kwargs must be a dict, got "
                                     f"{type(dataloader_kwargs).__name__}")
        generator = None
        if seed is not None:
            generator = torch.Generator()
            generator.manual_seed(seed)
        loader = DataLoader(
            dataset=cast(Any, self), batch_size=mini_batch_size, collate_fn=collate_fn,
            generator=generator, **(dataloader_kwargs or {}),
        )

        def batches() -> Any:
            for _ in range(epochs):
                for mini in loader:
                    mini.meta_info = self.meta_info
                    yield mini

        return iter(batches())

    # ---- persistence, devices and inspection --------------------------------------------------
    def save_to_disk(self, filepath: str) -> None:
        """Write everything (tensors, object arrays, meta_info) to one file."""
        payload = {
            "batch": None if self.batch is None else {k: v for k, v in self.batch.items()},
            "batch_size": None if self.batch is None else list(self.batch.batch_size),
            "non_tensor_batch": self.non_tensor_batch, "meta_info": self.meta_info,
        }
        torch.save(payload, filepath)

    @staticmethod
    def load_from_disk(filepath: str) -> DataProto:
        """Inverse of :meth:`save_to_disk`."""
        payload = torch.load(filepath, weights_only=False)
        batch = None
        if payload["batch"] is not None:
            batch = TensorDict(payload["batch"], batch_size=payload["batch_size"])
        return DataProto(
            batch=batch, non_tensor_batch=payload["non_tensor_batch"],
            meta_info=payload["meta_info"],
        )

    def to(self, device: str | torch.device) -> DataProto:
        """Move tensors to ``device`` (in place); returns self."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def print_size(self, prefix: str = "") -> None:
        """Print the tensor bytes (MiB) and the number of non-tensor columns."""
        leaves = (
            [] if self.batch is None else self.batch.values(include_nested=True, leaves_only=True)
        )
        nbytes = sum(t.nbytes for t in leaves if isinstance(t, torch.Tensor))
        print(f"{prefix}DataProto: {len(self)} rows, tensors {nbytes / 2**20:.3f} MiB, "
              f"{len(self.non_tensor_batch)} non-tensor columns")

    def get_data_info(self) -> str:
        """A multi-line summary: each tensor's shape, dtype and device, each column's shape and
        dtype, and the (recursive) type of each meta_info value."""
        return data_info(self.batch, self.non_tensor_batch, self.meta_info)

    def __repr__(self) -> str:
        keys = [] if self.batch is None else list(self.batch.keys())
        return (
            f"DataProto(len={len(self)}, batch_keys={keys}, "
            f"non_tensor_keys={list(self.non_tensor_batch)}, "
            f"meta_info_keys={list(self.meta_info)})"
        )


def collate_fn(x: list[DataProtoItem]) -> DataProto:
    """Stack rows (``DataProtoItem``s, e.g. from a DataLoader over a DataProto) back into a
    DataProto."""
    batches = [item.batch for item in x]
    batch = None
    if batches and batches[0] is not None:
        batch = cast(TensorDict, torch.stack(cast(Any, batches)).contiguous())
    columns = list_of_dict_to_dict_of_list([item.non_tensor_batch for item in x])
    return DataProto(batch=batch, non_tensor_batch={k: stack_rows(v) for k, v in columns.items()})
