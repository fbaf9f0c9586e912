"""A pickled DataProto leaves out the rollout layout's derived columns and padding runs
(agentloop.batch.protocol_wire) and comes back bit-identical: every column, dtype and key order."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from agentloop.batch import protocol_wire
from agentloop.batch.protocol import DataProto


@pytest.fixture(autouse=True)
def _shrink_every_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The small batches below are shrunk too (the shipped threshold is 64 KB of tensors)."""
    monkeypatch.setattr(protocol_wire, "SHRINK_ABOVE", 0)


def _rollout(rows: int = 32, prompt: int = 24, response: int = 12, seed: int = 0) -> dict:
    """verl's padded rollout layout as postprocess builds it (rows of every length, 0 too)."""
    rng = np.random.default_rng(seed)
    kept_p, kept_r = rng.integers(0, prompt + 1, rows), rng.integers(0, response + 1, rows)
    kept_p[0], kept_r[0] = 0, 0  # an empty row
    prompts = np.full((rows, prompt), 7, dtype=np.int64)
    responses = np.full((rows, response), 7, dtype=np.int64)
    for i in range(rows):
        prompts[i, prompt - kept_p[i]:] = rng.integers(100, 150_000, kept_p[i])
        responses[i, :kept_r[i]] = rng.integers(100, 150_000, kept_r[i])
    start, total = prompt - kept_p, kept_p + kept_r
    rel = np.arange(prompt + response)[None, :] - start[:, None]
    cols = {
        "prompts": prompts, "responses": responses,
        "response_mask": (np.arange(response)[None, :] < kept_r[:, None]).astype(np.int64),
        "input_ids": np.concatenate([prompts, responses], axis=1),
        "attention_mask": ((rel >= 0) & (rel < total[:, None])).astype(np.int64),
        "position_ids": np.clip(rel, 0, np.maximum(total - 1, 0)[:, None]),
        "rollout_log_probs": np.where(
            np.arange(response)[None, :] < kept_r[:, None], -rng.random((rows, response)), 0.0
        ).astype(np.float32),
    }
    return {k: torch.from_numpy(v) for k, v in cols.items()}


def _round_trip(tensors: dict[str, torch.Tensor]) -> tuple[DataProto, DataProto, dict]:
    rows = len(next(iter(tensors.values())))
    data = DataProto.from_dict(tensors, {"uid": np.array(["u"] * rows, dtype=object)})
    state = data.__getstate__()
    back = pickle.loads(pickle.dumps(data, protocol=5))
    return data, back, state


def _assert_identical(data: DataProto, back: DataProto) -> None:
    assert data.batch is not None and back.batch is not None
    assert list(back.batch.keys()) == list(data.batch.keys())
    for key in list(data.batch.keys()):
        a, b = data.batch[key], back.batch[key]
        assert b.dtype == a.dtype and b.shape == a.shape, key
        assert b.numpy().view(np.uint8).tobytes() == a.numpy().view(np.uint8).tobytes(), key
        assert b.numpy().flags.writeable, key


def test_rollout_layout_leaves_out_the_derived_columns_and_comes_back_identical() -> None:
    data, back, state = _round_trip(_rollout())
    assert set(state["batch"]["tensors"]) == {
        "prompts", "responses", "response_mask", "rollout_log_probs",
    }
    assert isinstance(state["batch"]["tensors"]["prompts"][0], tuple)  # its padding runs trimmed
    _assert_identical(data, back)
    assert list(back.non_tensor_batch["uid"]) == ["u"] * len(data)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8, torch.int64])
def test_the_rebuilt_columns_keep_their_own_dtype(dtype: torch.dtype) -> None:
    tensors = _rollout(prompt=20, response=10)
    for key in ("input_ids", "attention_mask", "position_ids"):
        tensors[key] = tensors[key].to(dtype)
    data, back, state = _round_trip(tensors)
    assert "derived" in state["batch"]
    _assert_identical(data, back)


def test_a_row_that_does_not_match_sends_its_column_as_is() -> None:
    tensors = _rollout()
    tensors["input_ids"][3, 5] += 1  # not concat(prompts, responses) any more
    tensors["position_ids"][4, -1] += 1  # not the span's position
    data, back, state = _round_trip(tensors)
    assert state["batch"]["derived"]["dtypes"].keys() == {"attention_mask"}
    assert {"input_ids", "position_ids"} <= set(state["batch"]["tensors"])
    _assert_identical(data, back)
    mask = _rollout()
    mask["attention_mask"][2, 0] = 1 - mask["attention_mask"][2, 0]  # a hole: no single span
    data, back, state = _round_trip(mask)
    assert state["batch"]["derived"]["dtypes"].keys() == {"input_ids"}
    assert {"attention_mask", "position_ids"} <= set(state["batch"]["tensors"])
    _assert_identical(data, back)


def test_multimodal_position_ids_travel_untouched() -> None:
    tensors = _rollout()
    rows, width = tensors["position_ids"].shape
    tensors["position_ids"] = tensors["position_ids"][:, None, :].repeat(1, 3, 1)  # M-RoPE (3-D)
    assert tensors["position_ids"].shape == (rows, 3, width)
    data, back, state = _round_trip(tensors)
    assert "position_ids" in state["batch"]["tensors"]
    assert set(state["batch"]["derived"]["dtypes"]) == {"input_ids", "attention_mask"}
    _assert_identical(data, back)


def test_float_bool_and_odd_columns_are_never_derived() -> None:
    tensors = _rollout()
    tensors["attention_mask"] = tensors["attention_mask"].bool()
    tensors["input_ids"] = tensors["input_ids"].float()
    data, back, state = _round_trip(tensors)
    assert "derived" not in state["batch"]
    _assert_identical(data, back)
    no_prompts = {k: v for k, v in _rollout().items() if k != "prompts"}
    data, back, state = _round_trip(no_prompts)
    assert "input_ids" in state["batch"]["tensors"]
    _assert_identical(data, back)


def test_trim_is_bit_exact_for_floats_and_leaves_dense_columns_alone() -> None:
    rng = np.random.default_rng(1)
    arr = np.zeros((16, 40), dtype=np.float32)
    arr[:, :5] = -0.0  # a signed zero: not the trailing pad's bits
    arr[3, 10] = np.nan
    arr[5, 6:9] = rng.random(3)
    back = protocol_wire.untrim(protocol_wire.trim(arr))
    assert back.dtype == arr.dtype and back.tobytes() == arr.tobytes()
    dense = rng.random((16, 40)).astype(np.float32)
    assert protocol_wire.trim(dense) is dense
    for empty in (np.zeros((0, 4), np.int8), np.zeros((4, 0), np.int8), np.arange(5)):
        assert protocol_wire.trim(empty) is empty
    with pytest.raises(ValueError, match="untrim"):
        protocol_wire.untrim(("nope",))


def test_elision_off_sends_every_column(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol_wire, "elide", False)
    data, back, state = _round_trip(_rollout())
    assert "derived" not in state["batch"] and len(state["batch"]["tensors"]) == 7
    assert all(isinstance(a, np.ndarray) for a, _ in state["batch"]["tensors"].values())
    _assert_identical(data, back)


def test_a_rollout_chunk_travels_in_well_under_half_its_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 128-row chunk of 128 + 64 tokens, rows of random lengths: what a worker ships."""
    data, _, _ = _round_trip(_rollout(rows=128, prompt=128, response=64))
    small = len(pickle.dumps(data, protocol=5))
    monkeypatch.setattr(protocol_wire, "elide", False)
    assert small < 0.45 * len(pickle.dumps(data, protocol=5))


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int64, np.uint8, np.float32, np.bool_])
def test_trim_round_trips_random_padded_arrays(dtype: type) -> None:
    rng = np.random.default_rng(2)
    for _ in range(40):
        rows, width = int(rng.integers(1, 30)), int(rng.integers(1, 50))
        arr = (rng.integers(0, 3, (rows, width)) * (rng.random((rows, width)) < 0.3)).astype(dtype)
        back = protocol_wire.untrim(protocol_wire.trim(arr))
        assert back.dtype == arr.dtype and back.shape == arr.shape
        assert back.tobytes() == arr.tobytes()


def test_a_batch_below_the_threshold_travels_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below ``SHRINK_ABOVE`` bytes of packed tensors the checks' fixed cost is not worth it."""
    monkeypatch.setattr(protocol_wire, "SHRINK_ABOVE", 64 * 1024)
    data, back, state = _round_trip(_rollout(rows=8, prompt=24, response=12))
    assert "derived" not in state["batch"] and len(state["batch"]["tensors"]) == 7
    assert all(isinstance(a, np.ndarray) for a, _ in state["batch"]["tensors"].values())
    _assert_identical(data, back)
    data, back, state = _round_trip(_rollout(rows=128, prompt=128, response=64))
    assert "derived" in state["batch"]
    _assert_identical(data, back)


@pytest.mark.parametrize("shrink", [True, False])
def test_a_forced_shrink_gives_what_the_threshold_gives(
    monkeypatch: pytest.MonkeyPatch, shrink: bool
) -> None:
    """``wire_state(shrink=...)`` (a worker's runs) builds the state the size threshold would
    choose, and it loads bit-identical; the columns left out are not packed first."""
    data = DataProto.from_dict(_rollout(rows=64, prompt=48, response=16))
    monkeypatch.setattr(protocol_wire, "SHRINK_ABOVE", 0 if shrink else 1 << 60)
    by_size = data.wire_state()
    forced = data.wire_state(shrink=shrink)
    assert pickle.dumps(forced, protocol=5) == pickle.dumps(by_size, protocol=5)
    assert ("derived" in forced["batch"]) is shrink
    assert len(forced["batch"]["tensors"]) == (4 if shrink else 7)
    back = DataProto.__new__(DataProto)
    back.__setstate__(forced)
    _assert_identical(data, back)
