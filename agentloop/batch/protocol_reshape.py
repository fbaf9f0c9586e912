"""Row operations of :class:`~agentloop.batch.protocol.DataProto` (a mixin it inherits): ``chunk``,
``split`` and ``concat`` cut and join batches, ``repeat``, ``sample_level_repeat``,
``unfold_column_chunks`` and ``padding`` change the number of rows (verl's semantics).

The methods use only what :class:`_Reshapeable` names, so this module never imports
:mod:`agentloop.batch.protocol`, which imports it.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar, cast

import numpy as np
import torch
from tensordict import TensorDict

from agentloop.batch.protocol_codec import packable
from agentloop.batch.protocol_errors import DataProtoError
from agentloop.batch.protocol_merge import merge_meta_info
from agentloop.batch.protocol_ops import DataProtoLike, split_rows
from agentloop.batch.protocol_utils import DataProtoConfig, check_same_keys

__all__ = ["DataProtoReshapeMixin", "plain_rows"]


def plain_rows(batch: Any) -> bool:
    """Whether ``batch`` is a plain 1-D TensorDict of CPU tensors with numpy dtypes (no grad, no
    dimension names)."""
    return (
        type(batch) is TensorDict and batch.batch_dims == 1 and batch.device is None
        and batch.names == [None]
        and all(packable(v) and not v.requires_grad for v in batch.values())
    )


def _cat_batches(batches: list[TensorDict]) -> TensorDict:
    """``torch.cat(batches, dim=0)``; plain batches (:func:`plain_rows`, same keys, dtypes and
    row shapes) are joined by numpy instead: torch copies large tensors on its intra-op thread
    pool, whose wake-up cost 30-50 ms per concat of a 256-row rollout on a loaded 2-core host
    (measured; issue 33), and numpy gives the same values and dtypes."""
    first = batches[0]
    keys = list(first.keys())
    if all(plain_rows(b) for b in batches) and all(list(b.keys()) == keys for b in batches):
        shapes = {k: (first[k].dtype, first[k].shape[1:]) for k in keys}
        if all((b[k].dtype, b[k].shape[1:]) == shapes[k] for b in batches[1:] for k in keys):
            tensors = {
                k: torch.from_numpy(np.concatenate([b[k].numpy() for b in batches], axis=0))
                for k in keys
            }
            return TensorDict(tensors, batch_size=[sum(b.batch_size[0] for b in batches)])
    return cast(TensorDict, torch.cat(batches, dim=0))  # type: ignore[arg-type]


class _Reshapeable(DataProtoLike, Protocol):
    """A DataProto as these methods see it: :class:`DataProtoLike` plus this mixin's own
    ``is_padding_enabled``."""

    def is_padding_enabled(self) -> bool: ...


_ReshapeT = TypeVar("_ReshapeT", bound=_Reshapeable)


class DataProtoReshapeMixin:
    """The row-count changing methods of a DataProto class (which inherits them)."""

    # the DataProto dataclass's fields (declared here for the type checker only)
    batch: TensorDict | None
    non_tensor_batch: dict[str, np.ndarray]
    meta_info: dict[str, Any]

    # ---- splitting and joining ----------------------------------------------------------------
    def is_padding_enabled(self: DataProtoLike) -> bool:
        """Whether :meth:`chunk` may split unevenly: ``from_dict(auto_padding=True)`` or
        ``DataProtoConfig.auto_padding`` (or ``VERL_AUTO_PADDING=1``)."""
        return bool(
            self.meta_info.get(DataProtoConfig.auto_padding_key, False)
            or DataProtoConfig.auto_padding
        )

    def chunk(self: _ReshapeT, chunks: int) -> list[_ReshapeT]:
        """Split into ``chunks`` equal parts (each keeps meta_info); like verl, ``len(self)`` must
        be divisible by ``chunks`` unless padding is enabled, in which case sizes differ by at most
        one."""
        if chunks < 1:
            raise DataProtoError(f"chunk: chunks must be >= 1, got {chunks}")
        if len(self) % chunks and not self.is_padding_enabled():
            raise DataProtoError(
                f"chunk: only support equal chunk. Got size of DataProto {len(self)} and "
                f"chunk {chunks}. Use "
                "agentloop.batch.protocol.split_rows(data, n) for uneven parts, or pad "
                "first (pad_dataproto_to_divisor)"
            )
        return split_rows(self, chunks)

    def split(self: _ReshapeT, split_size: int) -> list[_ReshapeT]:
        """Consecutive parts of ``split_size`` rows (the last may be shorter)."""
        if split_size < 1:
            raise DataProtoError(f"split: split_size must be >= 1, got {split_size}")
        return [self.slice(i, i + split_size) for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: list[_ReshapeT]) -> _ReshapeT:
        """Row-wise concatenation.  meta_info is merged as in verl: every part's keys are kept, a
        key in several parts must hold equal values, and ``metrics`` from all parts become one dict
        of lists."""
        if not data:
            raise DataProtoError("concat: got an empty list; pass at least one DataProto")
        check_same_keys(data)
        batch = None
        if data[0].batch is not None:
            batch = _cat_batches([cast(TensorDict, d.batch) for d in data])
        non = {
            k: np.concatenate([d.non_tensor_batch[k] for d in data], axis=0)
            for k in data[0].non_tensor_batch
        }
        return type(data[0])(
            batch=batch, non_tensor_batch=non,
            meta_info=merge_meta_info([d.meta_info for d in data]),
        )

    def repeat(self: _ReshapeT, repeat_times: int = 2, interleave: bool = True) -> _ReshapeT:
        """Each row ``repeat_times`` times: ``aabb`` with interleave, ``abab`` without."""
        n = len(self)
        idx = (
            np.repeat(np.arange(n), repeat_times)
            if interleave
            else np.tile(np.arange(n), repeat_times)
        )
        return self.select_idxs(idx)

    def sample_level_repeat(self: _ReshapeT, repeat_times: Any) -> _ReshapeT:
        """Row ``i`` repeated ``repeat_times[i]`` times, in order (a list, tuple, 1-D array or
        1-D tensor)."""
        if isinstance(repeat_times, (torch.Tensor, np.ndarray)):
            if repeat_times.ndim != 1:
                raise DataProtoError(f"sample_level_repeat: repeat_times must be 1-D, got shape "
                                     f"{tuple(repeat_times.shape)}")
            repeat_times = repeat_times.tolist()
        if not isinstance(repeat_times, (list, tuple)):
            raise DataProtoError(
                f"sample_level_repeat: repeat_times type must be in [list, "
                f"torch.Tensor, "
                f"np.ndarray, tuple], got {type(repeat_times).__name__}"
            )
        if len(repeat_times) != len(self):
            raise DataProtoError(
                f"sample_level_repeat: {len(repeat_times)} repeat counts "
                f"for {len(self)} rows; "
                "give one count per row"
            )
        return self.select_idxs(
            np.repeat(np.arange(len(self)), np.asarray(repeat_times, dtype=np.int64))
        )

    def unfold_column_chunks(
        self: _ReshapeT, n_split: int, split_keys: list[str] | None = None
    ) -> _ReshapeT:
        """Cut each ``split_keys`` column along dim 1 into ``n_split`` pieces that become
        consecutive rows (``[B, n*k, ...]`` -> ``[B*n, k, ...]``); every other column is repeated
        ``n_split`` times per row."""
        keys = set(split_keys or [])

        def unfold(key: str, value: Any, repeat: Any) -> Any:
            if key not in keys:
                return repeat(value)
            if value.ndim < 2 or value.shape[1] % n_split:
                raise DataProtoError(
                    f"unfold_column_chunks: {key!r} has shape "
                    f"{tuple(value.shape)}; its dim 1 must "
                    f"exist and be divisible by n_split={n_split}"
                )
            return value.reshape(
                value.shape[0] * n_split, value.shape[1] // n_split, *value.shape[2:]
            )

        batch = None
        if self.batch is not None:
            cols = {
                k: unfold(k, v, lambda t: t.repeat_interleave(n_split, dim=0))
                for k, v in self.batch.items()
            }
            batch = TensorDict(cols, batch_size=[len(self) * n_split], device=self.batch.device)
        non = {
            k: unfold(k, v, lambda a: np.repeat(a, n_split, axis=0))
            for k, v in self.non_tensor_batch.items()
        }
        return type(self)(batch=batch, non_tensor_batch=non, meta_info=dict(self.meta_info))

    def padding(self: _ReshapeT, padding_size: int, padding_candidate: str = "") -> _ReshapeT:
        """Append ``padding_size`` copies of the last row (the first with
        ``padding_candidate="first"``) in place, as verl does; returns self.  For padding to a
        multiple use :func:`pad_dataproto_to_divisor`."""
        if padding_size < 0:
            raise DataProtoError(f"padding: padding_size must be >= 0, got {padding_size}")
        if padding_size == 0:
            return self
        if len(self) == 0:
            raise DataProtoError(f"padding: cannot pad an empty DataProto with {padding_size} rows")
        row = 0 if padding_candidate == "first" else len(self) - 1
        padded = self.select_idxs(
            np.concatenate([np.arange(len(self)), np.full(padding_size, row)])
        )
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch
        return self
