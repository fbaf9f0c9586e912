"""Issue 33 item 1: the manager copies each row range into the batch as it comes back
(agentloop.batch.assembly); the batch equals ``DataProto.concat(align_keys(parts))`` exactly, and
whatever does not fit one buffer is joined by that concat instead."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agentloop.batch.assembly import RowAssembler
from agentloop.batch.metrics import align_keys
from agentloop.batch.protocol import DataProto
from agentloop.batch.protocol_errors import DataProtoError
from tests.unit.padding_helpers import assert_same_rows


def _part(first: int, rows: int, seed: int = 0, **meta: object) -> DataProto:
    rng = np.random.default_rng(first + seed)
    ids = torch.from_numpy(rng.integers(0, 50_000, (rows, 12)))
    return DataProto.from_dict(
        {
            "input_ids": ids, "attention_mask": (ids > 100).to(torch.int64),
            "rollout_log_probs": torch.from_numpy(rng.random((rows, 5)).astype(np.float32)),
            "is_valid": torch.ones(rows, dtype=torch.bool),
        },
        {
            "index": np.arange(first, first + rows),
            "raw_prompt": np.array([[{"role": "user", "content": str(i)}]
                                    for i in range(first, first + rows)] + [None],
                                   dtype=object)[:rows],
            "tools_kwargs": np.array([{"a": i} for i in range(rows)], dtype=object),
            "error": np.array([None] * rows, dtype=object),
            "__num_turns__": np.full(rows, 2, dtype=np.int32),
            "pair": np.array([[i, str(i)] for i in range(rows)], dtype=object),
        },
        {"global_steps": 3, "metrics": [{"t": float(i)} for i in range(rows)], **meta},
    )


def _join(parts: list[DataProto], order: list[int], expected: list[int] | None = None,
          ) -> tuple[RowAssembler, DataProto]:
    """Parts added in ``order`` (each at its first row), then joined."""
    firsts = np.cumsum([0] + (expected or [len(p) for p in parts]))
    assembler = RowAssembler(int(firsts[-1]))
    for i in order:
        assembler.add(int(firsts[i]), (expected or [len(p) for p in parts])[i], parts[i])
    return assembler, assembler.join(parts)


def test_ranges_arriving_in_any_order_give_what_concat_gives() -> None:
    sizes = [5, 3, 8, 1]
    firsts = np.cumsum([0, *sizes])
    parts = [_part(int(firsts[i]), n) for i, n in enumerate(sizes)]
    want = DataProto.concat(align_keys([_part(int(firsts[i]), n) for i, n in enumerate(sizes)]))
    assembler, got = _join(parts, order=[2, 0, 3, 1])
    assert assembler.result(parts) is not None  # built from the buffer, not by the concat
    assert_same_rows(got, want)
    assert got.batch is not None and got.batch.batch_size == torch.Size([17])
    assert got.non_tensor_batch["index"].tolist() == list(range(17))


@pytest.mark.parametrize("change", ["rows", "dtype", "missing_column", "not_plain"])
def test_parts_that_do_not_fit_one_buffer_are_joined_by_concat(change: str) -> None:
    parts = [_part(0, 4), _part(4, 4)]
    expected = None
    if change == "rows":  # a range came back with another row count (several trajectories)
        parts[1] = _part(4, 6)
        expected = [4, 4]
    elif change == "dtype":  # concat would widen int32 to int64: so must the join
        parts[1].non_tensor_batch["__num_turns__"] = np.full(4, 2, dtype=np.int64)
    elif change == "missing_column":  # align_keys gives that range None cells
        del parts[0].non_tensor_batch["error"]
    else:  # a column that needs its gradient kept: torch.cat's business
        assert parts[1].batch is not None
        parts[1].batch["rollout_log_probs"] = parts[1].batch["rollout_log_probs"].requires_grad_()
    copies = [DataProto(p.batch.clone() if p.batch is not None else None,
                        dict(p.non_tensor_batch), dict(p.meta_info)) for p in parts]
    want = DataProto.concat(align_keys(copies))
    assembler, got = _join(parts, order=[1, 0], expected=expected)
    assert assembler.result(parts) is None
    assert_same_rows(got, want)


def test_a_range_never_added_or_conflicting_meta_info_is_not_hidden() -> None:
    parts = [_part(0, 4), _part(4, 4)]
    assembler = RowAssembler(8)
    assembler.add(0, 4, parts[0])
    assert assembler.result(parts) is None  # rows 4-8 were never copied in
    parts = [_part(0, 4, tag="a"), _part(4, 4, tag="b")]
    with pytest.raises(DataProtoError, match="Conflicting values for meta_info key 'tag'"):
        _join(parts, order=[0, 1])
