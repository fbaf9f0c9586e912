"""A batch's rows copied into one batch-sized buffer as its parts arrive (issue 33 item 1).

``AgentLoopManager.generate_sequences`` gets a batch back as row ranges, one per worker chunk, that
arrive one after another; joining them with ``DataProto.concat`` at the end copies every row after
the last one came. :class:`RowAssembler` copies each range into its place when it arrives, so after
the last one only its own rows are copied. :meth:`RowAssembler.result` gives exactly what
``DataProto.concat`` of the same parts gives (columns, key order, dtypes, values, ``meta_info``), or
None whenever the parts do not fit one buffer (a row range that came back with another row count,
columns, dtypes or row shapes that differ between parts, a batch that is not a plain TensorDict of
CPU tensors); the caller then concatenates as before.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch
from tensordict import TensorDict

from agentloop.batch.metrics import align_keys
from agentloop.batch.protocol import DataProto
from agentloop.batch.protocol_merge import merge_meta_info
from agentloop.batch.protocol_reshape import plain_rows

__all__ = ["RowAssembler"]


def _layout(part: DataProto) -> tuple[Any, ...] | None:
    """What must agree between parts for their rows to share a buffer: per column its name,
    dtype and row shape, in order; None for a batch the buffer cannot hold."""
    if part.batch is None or not plain_rows(part.batch) or not all(
        isinstance(v, np.ndarray) for v in part.non_tensor_batch.values()
    ):
        return None
    tensors = tuple((k, v.dtype, tuple(v.shape[1:])) for k, v in part.batch.items())
    non = tuple((k, v.dtype, v.shape[1:]) for k, v in part.non_tensor_batch.items())
    return tensors, non


class RowAssembler:
    """Rows of a ``rows``-row batch, copied into place part by part (see the module docstring)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.layout: tuple[Any, ...] | None = None
        self.tensors: dict[str, np.ndarray] = {}
        self.non_tensors: dict[str, np.ndarray] = {}
        self.filled = 0
        self.broken = False

    def add(self, offset: int, expected: int, part: DataProto) -> None:
        """Copy ``part`` (the rows of input rows ``offset:offset + expected``) into place; a part
        that does not fit (see the module docstring) turns the assembler off."""
        if self.broken:
            return
        layout = _layout(part)
        if layout is None or len(part) != expected or offset + expected > self.rows or (
            self.layout is not None and layout != self.layout
        ):
            self.broken = True
            return
        assert part.batch is not None
        if self.layout is None:
            self.layout = layout
            self.tensors = {
                k: np.empty((self.rows, *v.shape[1:]), dtype=cast(torch.Tensor, v).numpy().dtype)
                for k, v in part.batch.items()
            }
            self.non_tensors = {
                k: np.empty((self.rows, *v.shape[1:]), dtype=cast(np.ndarray, v).dtype)
                for k, v in part.non_tensor_batch.items()
            }
        end = offset + expected
        for k, v in part.batch.items():
            self.tensors[k][offset:end] = cast(torch.Tensor, v).numpy()
        for k, arr in part.non_tensor_batch.items():
            self.non_tensors[k][offset:end] = arr
        self.filled += expected

    def result(self, parts: list[DataProto]) -> DataProto | None:
        """The batch that ``DataProto.concat(parts)`` gives, from the buffer; None when the buffer
        does not hold exactly ``parts`` (every part added, each in its place, none changed in
        layout since: e.g. a column added to some parts before the join)."""
        if self.broken or self.layout is None or self.filled != self.rows:
            return None
        if any(_layout(p) != self.layout for p in parts) or sum(map(len, parts)) != self.rows:
            return None
        batch = TensorDict(
            {k: torch.from_numpy(v) for k, v in self.tensors.items()}, batch_size=[self.rows]
        )
        return DataProto(
            batch=batch, non_tensor_batch=dict(self.non_tensors),
            meta_info=merge_meta_info([p.meta_info for p in parts]),
        )

    def join(self, parts: list[DataProto]) -> DataProto:
        """``DataProto.concat(align_keys(parts))``: from the buffer when it holds exactly the
        aligned parts, else by that concat."""
        aligned = align_keys(parts)
        return self.result(aligned) or DataProto.concat(aligned)
