"""Helpers shared by the padding tests (test_group_padding, test_wire_runs): padding a range of
outputs the same way each time, and comparing padded rows column by column."""

from __future__ import annotations

import numpy as np
import torch

from agentloop.batch.postprocess import postprocess
from agentloop.batch.protocol import DataProto
from agentloop.types import AgentLoopOutput


def pad_range(outputs: list[AgentLoopOutput], a: int, b: int, prompt_length: int) -> DataProto:
    """Outputs ``a:b`` padded (response width 7, log-probs, a ``uid`` per row)."""
    return postprocess(
        outputs[a:b], prompt_length=prompt_length, response_length=7, pad_token_id=0,
        sample_fields={"uid": np.asarray([f"u{i}" for i in range(a, b)], dtype=object)},
        calculate_log_probs=True,
    )


def assert_same_rows(got: DataProto, want: DataProto) -> None:
    """Equal columns (names, order, dtypes, shapes, values) and ``meta_info``."""
    assert got.batch is not None and want.batch is not None
    assert list(got.batch.keys()) == list(want.batch.keys())
    for key in want.batch.keys():  # noqa: SIM118 - iterating a TensorDict walks rows
        assert got.batch[key].dtype == want.batch[key].dtype, key
        assert torch.equal(got.batch[key], want.batch[key]), key
    assert list(got.non_tensor_batch) == list(want.non_tensor_batch)
    for key, col in want.non_tensor_batch.items():
        assert got.non_tensor_batch[key].dtype == col.dtype
        assert got.non_tensor_batch[key].shape == col.shape
        assert got.non_tensor_batch[key].tolist() == col.tolist(), key
    assert got.meta_info == want.meta_info
