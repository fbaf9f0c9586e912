"""DataProto behaviour a verl user relies on: indexing, key ops, chunk/concat, repeat, padding,
persistence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agentloop.batch.protocol import (
    DataProto,
    DataProtoItem,
    pad_dataproto_to_divisor,
    split_rows,
    unpad_dataproto,
)
from agentloop.errors import DatasetError


def obj(values: list) -> np.ndarray:
    """1-D object array whose entries may themselves be lists / dicts."""
    arr = np.empty(len(values), dtype=object)
    arr[:] = values
    return arr


def make(n: int = 5, meta: dict | None = None) -> DataProto:
    """Rows i = 0..n-1: ids [i, i+100], uid "u{i}", a ragged list and a dict per row."""
    ids = torch.stack([torch.arange(n), torch.arange(n) + 100], dim=1)
    return DataProto.from_dict(
        {"ids": ids, "score": torch.arange(n, dtype=torch.float32)},
        {"uid": obj([f"u{i}" for i in range(n)]), "tools": obj([list(range(i)) for i in range(n)]),
         "info": obj([{"k": i} for i in range(n)])},
        meta or {"temperature": 1.0},
    )


def uids(d: DataProto) -> list[str]:
    return d.non_tensor_batch["uid"].tolist()


def assert_same(a: DataProto, b: DataProto) -> None:
    assert len(a) == len(b)
    assert (a.batch is None) == (b.batch is None)
    if a.batch is not None:
        assert set(a.batch.keys()) == set(b.batch.keys())
        for k in sorted(a.batch.keys()):
            assert torch.equal(a.batch[k], b.batch[k]), k
    assert set(a.non_tensor_batch) == set(b.non_tensor_batch)
    for k, v in a.non_tensor_batch.items():
        assert v.tolist() == b.non_tensor_batch[k].tolist(), k


def test_construction_checks_row_counts_and_names_the_key() -> None:
    with pytest.raises(DatasetError, match=r"'uid'.*3.*5"):
        DataProto.from_dict({"ids": torch.zeros(5, 2)}, {"uid": obj(["a", "b", "c"])})
    with pytest.raises(DatasetError, match="'b'"):
        DataProto.from_dict({"a": torch.zeros(5), "b": torch.zeros(4)})


def test_from_single_dict_splits_tensors_and_arrays() -> None:
    d = DataProto.from_single_dict(
        {"ids": torch.ones(3, 2), "uid": obj(["a", "b", "c"])}, meta_info={"x": 1}
    )
    assert list(d.batch.keys()) == ["ids"]
    assert list(d.non_tensor_batch) == ["uid"]
    assert d.meta_info == {"x": 1}
    with pytest.raises(DatasetError, match="bad"):
        DataProto.from_single_dict({"ids": torch.ones(3), "bad": [1, 2, 3]})


def test_indexing_int_slice_and_index_lists() -> None:
    d = make()
    item = d[2]
    assert isinstance(item, DataProtoItem)
    assert item.batch["ids"].tolist() == [2, 102]
    assert item.non_tensor_batch["tools"] == [0, 1]
    assert uids(d[1:3]) == ["u1", "u2"]
    assert d[1:3].batch["ids"][:, 0].tolist() == [1, 2]
    for idx in ([4, 0], np.array([4, 0]), torch.tensor([4, 0])):
        picked = d[idx]
        assert uids(picked) == ["u4", "u0"] and picked.batch["ids"][:, 0].tolist() == [4, 0]
    assert uids(d.select_idxs(np.array([True, False, False, False, True]))) == ["u0", "u4"]


def test_batch_none_is_supported() -> None:
    d = DataProto(batch=None, non_tensor_batch={"uid": obj(["a", "b", "c"])})
    assert len(d) == 3
    assert uids(d.repeat(2)) == ["a", "a", "b", "b", "c", "c"]
    assert uids(DataProto.concat(split_rows(d, 2))) == ["a", "b", "c"]
    padded, pad = pad_dataproto_to_divisor(d, 2)
    assert pad == 1 and uids(padded) == ["a", "b", "c", "a"]
    assert d[1].non_tensor_batch == {"uid": "b"} and d[1].batch is None


def test_select_and_pop() -> None:
    d = make()
    s = d.select(batch_keys=["ids"], non_tensor_batch_keys=["uid"], meta_info_keys=[])
    assert (
        list(s.batch.keys()) == ["ids"]
        and list(s.non_tensor_batch) == ["uid"]
        and s.meta_info == {}
    )
    assert set(d.batch.keys()) == {"ids", "score"}  # select leaves the source alone
    deep = d.select(deepcopy=True)
    deep.batch["ids"][0, 0] = 99
    assert d.batch["ids"][0, 0] == 0
    popped = d.pop(
        batch_keys=["score"], non_tensor_batch_keys=["info"], meta_info_keys=["temperature"]
    )
    assert list(popped.batch.keys()) == ["score"] and list(popped.non_tensor_batch) == ["info"]
    assert popped.meta_info == {"temperature": 1.0}
    assert (
        list(d.batch.keys()) == ["ids"] and "info" not in d.non_tensor_batch and d.meta_info == {}
    )


def test_union_merges_and_rejects_conflicts_by_key() -> None:
    left = make().select(batch_keys=["ids"], non_tensor_batch_keys=["uid"])
    right = make().select(batch_keys=["ids", "score"], non_tensor_batch_keys=["uid", "tools"])
    merged = left.union(right)
    assert set(merged.batch.keys()) == {"ids", "score"} and set(merged.non_tensor_batch) == {
        "uid",
        "tools",
    }

    other = make()
    other.batch["score"] = other.batch["score"] + 1
    with pytest.raises(DatasetError, match="'score'"):
        make().union(other)
    other = make()
    other.non_tensor_batch["uid"] = obj(["x"] * 5)
    with pytest.raises(DatasetError, match="`uid`"):
        make().union(other)


@pytest.mark.parametrize(
    ("n", "chunks", "sizes"), [(6, 3, [2, 2, 2]), (7, 3, [3, 2, 2]), (2, 3, [1, 1, 0])]
)
def test_chunk_concat_round_trip(n: int, chunks: int, sizes: list[int]) -> None:
    """Even sizes go through ``chunk``; uneven ones need ``split_rows`` (``chunk`` refuses them,
    as in verl)."""
    d = make(n)
    if n % chunks:
        with pytest.raises(DatasetError, match="split_rows"):
            d.chunk(chunks)
    parts = d.chunk(chunks) if n % chunks == 0 else split_rows(d, chunks)
    assert [len(p) for p in parts] == sizes
    assert all(p.meta_info == {"temperature": 1.0} for p in parts)
    back = DataProto.concat(parts)
    assert_same(back, d)
    assert back.meta_info == {"temperature": 1.0}


def test_split_and_concat_errors() -> None:
    d = make(5)
    assert [uids(p) for p in d.split(2)] == [["u0", "u1"], ["u2", "u3"], ["u4"]]
    with pytest.raises(DatasetError, match="score"):
        DataProto.concat([make(2), make(2).select(batch_keys=["ids"])])


def test_concat_merges_metrics_into_a_dict_of_lists_and_rejects_conflicts() -> None:
    """verl's rule: per-row metrics dicts from every part become one dict of lists; other keys
    must agree."""
    a, b = (
        make(2, {"metrics": [{"t": 1}, {"t": 2}], "step": 3}),
        make(1, {"metrics": [{"t": 3}], "step": 3}),
    )
    assert DataProto.concat([a, b]).meta_info == {"metrics": {"t": [1, 2, 3]}, "step": 3}
    with pytest.raises(DatasetError, match="'step'.*part 0 has 3, part 1 has 9"):
        DataProto.concat([a, make(1, {"step": 9})])


def test_repeat_interleave_vs_tile() -> None:
    d = make(2)
    inter, tiled = d.repeat(3, interleave=True), d.repeat(3, interleave=False)
    assert uids(inter) == ["u0", "u0", "u0", "u1", "u1", "u1"]
    assert inter.batch["ids"][:, 0].tolist() == [0, 0, 0, 1, 1, 1]
    assert uids(tiled) == ["u0", "u1", "u0", "u1", "u0", "u1"]
    assert tiled.batch["ids"][:, 0].tolist() == [0, 1, 0, 1, 0, 1]


def test_pad_to_divisor_and_unpad_round_trip() -> None:
    d = make(5)
    padded, pad = pad_dataproto_to_divisor(d, 4)
    assert pad == 3 and len(padded) == 8
    assert uids(padded) == ["u0", "u1", "u2", "u3", "u4", "u0", "u1", "u2"]
    assert_same(unpad_dataproto(padded, pad), d)
    same, zero = pad_dataproto_to_divisor(d, 5)
    assert zero == 0 and len(same) == 5
    # Padding longer than the data cycles through it again.
    assert uids(pad_dataproto_to_divisor(make(2), 7)[0]) == [
        "u0", "u1", "u0", "u1", "u0", "u1", "u0",
    ]


def test_save_load_round_trip_with_object_arrays(tmp_path) -> None:
    d = make(4, {"metrics": [{"a": 1.5}], "nested": {"x": [1, 2]}})
    d.non_tensor_batch["index"] = np.arange(4)
    path = tmp_path / "batch.dp"
    d.save_to_disk(str(path))
    back = DataProto.load_from_disk(str(path))
    assert_same(back, d)
    assert back.non_tensor_batch["tools"][3] == [0, 1, 2] and back.non_tensor_batch["info"][2] == {
        "k": 2
    }
    assert back.non_tensor_batch["index"].dtype == np.arange(4).dtype
    assert back.meta_info == d.meta_info

    only_objects = DataProto(batch=None, non_tensor_batch={"uid": obj(["a"])})
    only_objects.save_to_disk(str(path))
    assert DataProto.load_from_disk(str(path)).batch is None


def test_rename_to_and_repr() -> None:
    d = make(3).rename("ids", "input_ids")
    assert set(d.batch.keys()) == {"input_ids", "score"}
    assert d.to("cpu").batch["input_ids"].device.type == "cpu"
    assert "len=3" in repr(d)


def test_pickle_is_exact_and_compact_for_rollout_tensors() -> None:
    """What Ray moves between workers and the driver: every value and dtype back bit-identical;
    integer tensors whose values fit travel narrowed (a rollout batch is mostly masks and small
    ids)."""
    import pickle

    n, width = 64, 320
    tensors = {
        "input_ids": torch.randint(0, 150_000, (n, width)),  # needs int32
        "attention_mask": torch.randint(0, 2, (n, width)),  # int8 on the wire
        "position_ids": torch.arange(width).repeat(n, 1),  # int16
        "big": torch.tensor([[2**40, -(2**40)]] * n),  # does not fit: stays int64
        "flags": torch.rand(n, 3) > 0.5,
        "logprobs": torch.randn(n, 7),
        "half": torch.randn(n, 2).half(),
        "empty": torch.zeros((n, 0), dtype=torch.int64),
        "int32_col": torch.full((n,), -5, dtype=torch.int32),
    }
    data = DataProto.from_dict(
        tensors, {"uid": obj([f"u{i}" for i in range(n)])}, {"metrics": [{"a": 1}]}
    )
    blob = pickle.dumps(data, protocol=5)
    back = pickle.loads(blob)
    assert_same(data, back)
    for k, v in tensors.items():
        assert back.batch[k].dtype == v.dtype, k
        assert back.batch[k].numpy().flags.writeable, k  # not a view of Ray's read-only buffer
    assert back.meta_info == {"metrics": [{"a": 1}]}
    plain = pickle.dumps({k: v for k, v in tensors.items()}, protocol=5)
    assert len(blob) < 0.6 * len(plain)


def test_pickle_keeps_tensors_it_cannot_pack() -> None:
    """bfloat16 (no numpy type) and nested TensorDicts fall back to plain pickling, still exact."""
    import pickle

    from tensordict import TensorDict

    n = 4
    data = DataProto.from_dict({"x": torch.randn(n, 3).bfloat16(), "ids": torch.arange(n)})
    back = pickle.loads(pickle.dumps(data))
    assert back.batch["x"].dtype == torch.bfloat16 and torch.equal(back.batch["x"], data.batch["x"])
    nested = DataProto(
        batch=TensorDict({"a": torch.arange(n), "sub": TensorDict({"b": torch.ones(n)}, [n])}, [n])
    )
    back = pickle.loads(pickle.dumps(nested))
    assert torch.equal(back.batch["sub", "b"], torch.ones(n)) and torch.equal(
        back.batch["a"], torch.arange(n)
    )
