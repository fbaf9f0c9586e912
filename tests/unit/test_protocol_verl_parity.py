"""DataProto behaviour that verl 0.9.1 users rely on beyond the basics: verl's chunk / concat /
padding rules, its module functions (unions, fold/unfold, collate_fn, DataProtoFuture,
serialization) and the TensorDict conversions — each checked the way a trainer or rollout would use
it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from agentloop.batch.protocol import (
    DataProto,
    DataProtoConfig,
    DataProtoError,
    DataProtoFuture,
    all_gather_data_proto,
    collate_fn,
    deserialize_single_tensor,
    deserialize_tensordict,
    fold_batch_dim,
    object_array,
    pad_dataproto_to_divisor,
    serialize_single_tensor,
    serialize_tensordict,
    split_rows,
    unfold_batch_dim,
    union_numpy_dict,
    union_tensor_dict,
)
from agentloop.errors import DatasetError
from agentloop.utils import tensordict_utils


def rollout(n: int = 4, meta: dict | None = None) -> DataProto:
    """A small rollout-shaped batch: row i has ids [i, 10+i], uid "q{i}" and a ragged list of i
    tool rewards."""
    return DataProto.from_dict(
        {
            "ids": torch.stack([torch.arange(n), torch.arange(n) + 10], dim=1),
            "mask": torch.ones(n, 2, dtype=torch.int8),
        },
        {
            "uid": object_array([f"q{i}" for i in range(n)]),
            "tool_rewards": object_array([[0.5] * i for i in range(n)]),
        },
        meta if meta is not None else {"step": 7},
    )


def uids(d: DataProto) -> list[str]:
    return d.non_tensor_batch["uid"].tolist()


@pytest.fixture
def no_auto_padding(monkeypatch):
    monkeypatch.delenv("VERL_AUTO_PADDING", raising=False)
    before = DataProtoConfig.auto_padding
    DataProtoConfig.auto_padding = False
    yield
    DataProtoConfig.auto_padding = before


# ---- errors
# ---------------------------------------------------------------------------------------
def test_errors_are_both_dataset_errors_and_assertion_errors() -> None:
    """Code written against verl catches AssertionError; agentloop code catches DatasetError."""
    with pytest.raises(AssertionError, match="only support equal chunk"):
        rollout(5).chunk(2)
    with pytest.raises(DatasetError):
        rollout(5).chunk(2)
    assert issubclass(DataProtoError, DatasetError) and issubclass(DataProtoError, AssertionError)


def test_only_one_batch_dim_and_none_columns_are_accepted() -> None:
    with pytest.raises(AssertionError, match="exactly one batch dim"):
        DataProto.from_dict({"x": torch.zeros(2, 3)}, num_batch_dims=2)
    empty = DataProto(batch=None, non_tensor_batch=None, meta_info=None)
    assert len(empty) == 0 and empty.non_tensor_batch == {} and empty.meta_info == {}
    with pytest.raises(DatasetError, match="'uid'.*object_array"):
        DataProto(batch=None, non_tensor_batch={"uid": ["a", "b"]})


def test_from_dict_turns_lists_into_object_arrays_like_verl() -> None:
    d = DataProto.from_dict(
        non_tensors={"pairs": [["a", "b"], ["c", "d"]], "ragged": [[1], [2, 3]]}
    )
    assert d.non_tensor_batch["pairs"].shape == (2, 2)  # equal-length lists -> 2-D, as in verl
    assert d.non_tensor_batch["ragged"].tolist() == [[1], [2, 3]]
    kept = DataProto.from_dict(non_tensors={"pairs": object_array([["a", "b"], ["c", "d"]])})
    assert kept.non_tensor_batch["pairs"].shape == (2,)  # object_array keeps one list per row


# ---- chunk / split_rows / padding ---------------------------------------------------------------
def test_chunk_needs_divisible_sizes_unless_padding_is_enabled(
    no_auto_padding, monkeypatch
) -> None:
    assert [uids(p) for p in rollout(4).chunk(2)] == [["q0", "q1"], ["q2", "q3"]]
    with pytest.raises(DataProtoError, match="size of DataProto 5 and chunk 2.*split_rows"):
        rollout(5).chunk(2)

    padded = DataProto.from_dict({"x": torch.arange(5)}, auto_padding=True)
    assert padded.is_padding_enabled()
    assert [len(p) for p in padded.chunk(2)] == [3, 2]

    DataProtoConfig.auto_padding = True
    assert rollout(5).is_padding_enabled() and [len(p) for p in rollout(5).chunk(3)] == [2, 2, 1]
    DataProtoConfig.auto_padding = False
    monkeypatch.setenv("VERL_AUTO_PADDING", "1")
    assert rollout(5).is_padding_enabled()
    with pytest.raises(AssertionError):
        DataProtoConfig.auto_padding = "yes"  # type: ignore[assignment]


def test_split_rows_spreads_prompts_over_workers() -> None:
    d = rollout(7)
    parts = split_rows(d, 3)
    assert [uids(p) for p in parts] == [["q0", "q1", "q2"], ["q3", "q4"], ["q5", "q6"]]
    assert all(p.meta_info == {"step": 7} for p in parts)
    assert [len(p) for p in split_rows(rollout(2), 3)] == [1, 1, 0]
    assert uids(DataProto.concat(parts)) == uids(d)


def test_padding_repeats_the_last_or_first_row_in_place() -> None:
    d = rollout(3)
    assert d.padding(2) is d
    assert uids(d) == ["q0", "q1", "q2", "q2", "q2"] and d.batch["ids"][:, 0].tolist() == [
        0, 1, 2, 2, 2,
    ]
    first = rollout(2)
    first.padding(1, padding_candidate="first")
    assert uids(first) == ["q0", "q1", "q0"]
    assert len(rollout(2).padding(0)) == 2


def test_pad_to_divisor_keeps_meta_info_as_is() -> None:
    """Padding to a multiple of the world size must not fold or duplicate a batch's metrics."""
    d = rollout(3, {"metrics": [{"t": 1.0}]})
    padded, pad = pad_dataproto_to_divisor(d, 4)
    assert pad == 1 and uids(padded) == ["q0", "q1", "q2", "q0"]
    assert padded.meta_info == {"metrics": [{"t": 1.0}]}


# ---- concat's meta_info rules
# ---------------------------------------------------------------------
def test_concat_keeps_every_parts_meta_keys_and_metrics() -> None:
    parts = [
        rollout(1, {"global_steps": 3}), rollout(1, {"global_steps": 3, "metrics": [{"gen": 0.2}]}),
        rollout(1, {"validate": True, "metrics": {"gen": 0.4}}), rollout(1, {"metrics": None}),
    ]
    meta = DataProto.concat(parts).meta_info
    assert meta == {"global_steps": 3, "validate": True, "metrics": {"gen": [0.2, 0.4]}}


def test_concat_rejects_disagreeing_meta_and_names_the_key() -> None:
    with pytest.raises(
        AssertionError, match="Conflicting values for meta_info key 'temperature'.*part 1"
    ):
        DataProto.concat([rollout(1, {"temperature": 1.0}), rollout(1, {"temperature": 0.7})])
    arrays = [rollout(1, {"w": np.array([1, 2])}), rollout(1, {"w": np.array([1, 2])})]
    # array values compare element-wise
    assert DataProto.concat(arrays).meta_info["w"].tolist() == [1, 2]
    with pytest.raises(DataProtoError, match="first dictionary"):
        DataProto.concat([rollout(1, {"metrics": [{"a": 1}]}), rollout(1, {"metrics": [{"b": 2}]})])


# ---- unions -------------------------------------------------------------------------------------
def test_union_numpy_dict_compares_nan_objects_and_cycles() -> None:
    scores = np.array([0.5, np.nan])
    assert union_numpy_dict({"s": scores}, {"s": scores.copy()})["s"] is not None
    with pytest.raises(
        AssertionError, match="`s` in tensor_dict1 and tensor_dict2 are not the same object"
    ):
        union_numpy_dict({"s": scores}, {"s": np.array([np.nan, 0.5])})
    nested = object_array([np.array([1, 2]), {"k": [1]}, "x"])
    union_numpy_dict({"n": nested}, {"n": object_array([np.array([1, 2]), {"k": [1]}, "x"])})
    with pytest.raises(DataProtoError):
        union_numpy_dict({"n": nested}, {"n": object_array([np.array([1, 3]), {"k": [1]}, "x"])})
    loop_a, loop_b = np.empty(1, dtype=object), np.empty(1, dtype=object)
    loop_a[0], loop_b[0] = loop_a, loop_b
    union_numpy_dict({"c": loop_a}, {"c": loop_b})  # terminates


def test_union_tensor_dict_adds_keys_and_checks_shared_ones() -> None:
    left = TensorDict({"a": torch.ones(2)}, batch_size=[2])
    merged = union_tensor_dict(
        left, TensorDict({"a": torch.ones(2), "b": torch.zeros(2)}, batch_size=[2])
    )
    assert merged is left and set(left.keys()) == {"a", "b"}
    with pytest.raises(AssertionError, match="'a'"):
        union_tensor_dict(left, TensorDict({"a": torch.zeros(2)}, batch_size=[2]))
    with pytest.raises(AssertionError, match="identical batch size"):
        union_tensor_dict(left, TensorDict({"c": torch.zeros(3)}, batch_size=[3]))


def test_dataproto_union_merges_meta_and_rejects_meta_conflicts() -> None:
    d = rollout(2, {"step": 1}).union(rollout(2, {"epoch": 0}))
    assert d.meta_info == {"step": 1, "epoch": 0}
    with pytest.raises(AssertionError, match="'step'"):
        rollout(2, {"step": 1}).union(rollout(2, {"step": 2}))


# ---- row operations ---------------------------------------------------------------------------
def test_indexing_variants_and_unsupported_types() -> None:
    d = rollout(4)
    assert d[torch.tensor(2)].non_tensor_batch["uid"] == "q2"  # a 0-d tensor is one index
    assert uids(d[[True, False, False, True]]) == ["q0", "q3"]
    assert d[np.array([3, 1])].batch.batch_size == torch.Size([2])
    with pytest.raises(TypeError, match="Indexing with str"):
        d["uid"]


def test_reorder_permutes_rows_in_place() -> None:
    d = rollout(3)
    d.reorder(torch.tensor([2, 0, 1]))
    assert uids(d) == ["q2", "q0", "q1"] and d.batch["ids"][:, 0].tolist() == [2, 0, 1]
    assert d.meta_info == {"step": 7}


def test_sample_level_repeat_gives_each_prompt_its_own_count() -> None:
    d = rollout(3)
    for counts in ([2, 0, 1], (2, 0, 1), np.array([2, 0, 1]), torch.tensor([2, 0, 1])):
        out = d.sample_level_repeat(counts)
        assert uids(out) == ["q0", "q0", "q2"] and out.batch["ids"][:, 0].tolist() == [0, 0, 2]
    with pytest.raises(AssertionError, match="3 rows"):
        d.sample_level_repeat([1, 1])
    with pytest.raises(AssertionError, match="repeat_times type"):
        d.sample_level_repeat(2)


def test_unfold_column_chunks_splits_grouped_columns_into_rows() -> None:
    d = DataProto.from_dict(
        {"pair": torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), "prompt": torch.tensor([[9], [8]])},
        {"names": np.array([["a", "b"], ["c", "d"]], dtype=object)}, {"k": 1},
    )
    out = d.unfold_column_chunks(2, split_keys=["pair", "names"])
    assert out.batch["pair"].tolist() == [[1, 2], [3, 4], [5, 6], [7, 8]]
    assert out.batch["prompt"].tolist() == [[9], [9], [8], [8]]
    assert out.non_tensor_batch["names"].tolist() == [["a"], ["b"], ["c"], ["d"]]
    assert out.meta_info == {"k": 1}
    everything_repeated = d.unfold_column_chunks(2)
    assert everything_repeated.batch["pair"].shape == (4, 4)
    with pytest.raises(DataProtoError, match="divisible by n_split=3"):
        d.unfold_column_chunks(3, split_keys=["pair"])


def test_fold_and_unfold_batch_dim_round_trip_through_a_group_shuffle() -> None:
    d = rollout(6).repeat(1)
    folded = fold_batch_dim(d, new_batch_size=3)
    assert folded.batch["ids"].shape == (3, 2, 2) and folded.non_tensor_batch["uid"].shape == (3, 2)
    folded.reorder(torch.tensor([2, 0, 1]))  # shuffle whole groups
    flat = unfold_batch_dim(folded, batch_dims=2)
    assert uids(flat) == ["q4", "q5", "q0", "q1", "q2", "q3"]
    assert flat.batch["ids"][:, 0].tolist() == [4, 5, 0, 1, 2, 3]
    assert uids(d) == [f"q{i}" for i in range(6)]  # the input is untouched
    with pytest.raises(AssertionError, match="not divisible"):
        fold_batch_dim(d, 4)


# ---- iteration ----------------------------------------------------------------------------------
def test_make_iterator_yields_mini_batches_with_meta_info() -> None:
    d = rollout(6)
    minis = list(d.make_iterator(mini_batch_size=2, epochs=2))
    assert len(minis) == 6 and all(
        isinstance(m, DataProto) and m.meta_info == {"step": 7} for m in minis
    )
    assert [uids(m) for m in minis[:3]] == [["q0", "q1"], ["q2", "q3"], ["q4", "q5"]]
    # lists stay per row
    assert minis[2].non_tensor_batch["tool_rewards"].tolist() == [[0.5] * 4, [0.5] * 5]
    assert minis[0].batch["mask"].dtype == torch.int8

    def order(seed: int) -> list[str]:
        return [
            u
            for m in d.make_iterator(2, 1, seed=seed, dataloader_kwargs={"shuffle": True})
            for u in uids(m)
        ]

    assert order(3) == order(3) and sorted(order(3)) == uids(d)
    with pytest.raises(AssertionError, match="6 % 4 != 0"):
        d.make_iterator(mini_batch_size=4, epochs=1)


def test_collate_fn_rebuilds_rows_in_their_original_layout() -> None:
    d = rollout(3)
    d.non_tensor_batch["index"] = np.arange(3)
    back = collate_fn([d[i] for i in range(3)])
    assert back.batch["ids"].tolist() == d.batch["ids"].tolist()
    assert back.non_tensor_batch["tool_rewards"].shape == (3,)
    assert back.non_tensor_batch["index"].dtype == d.non_tensor_batch["index"].dtype


# ---- TensorDict conversion ----------------------------------------------------------------------
def test_to_and_from_tensordict_round_trip_nested_rows() -> None:
    d = rollout(3, {"global_steps": 5})
    d.non_tensor_batch["raw_prompt"] = object_array(
        [[{"role": "user", "content": f"hi {i}"}] for i in range(3)]
    )
    td = d.to_tensordict()
    assert td["uid"] == ["q0", "q1", "q2"] and td["global_steps"] == 5
    back = DataProto.from_tensordict(td)
    assert back.meta_info == {"global_steps": 5}
    assert torch.equal(back.batch["ids"], d.batch["ids"])
    # one message per row stays a list per row (not a 2-D array of dicts)
    assert back.non_tensor_batch["raw_prompt"].shape == (3,)
    assert back.non_tensor_batch["raw_prompt"][1] == [{"role": "user", "content": "hi 1"}]
    assert back.non_tensor_batch["tool_rewards"].tolist() == [[], [0.5], [0.5, 0.5]]
    with pytest.raises(AssertionError, match="both batch and non_tensor_batch"):
        clash = DataProto(
            batch=TensorDict({"uid": torch.zeros(3)}, [3]), non_tensor_batch={"uid": np.arange(3)}
        )
        clash.to_tensordict()


def test_get_tensordict_shim_builds_what_from_tensordict_reads() -> None:
    td = tensordict_utils.get_tensordict({"x": torch.arange(2), "tags": [["a"], []]}, {"run": "r1"})
    d = DataProto.from_tensordict(td, meta_info={"extra": 1})
    assert d.batch["x"].tolist() == [0, 1] and d.non_tensor_batch["tags"].tolist() == [["a"], []]
    assert d.meta_info == {"extra": 1, "run": "r1"}
    with pytest.raises(AssertionError, match="expected 2"):
        tensordict_utils.get_tensordict({"x": torch.arange(2), "y": [1, 2, 3]})


# ---- key operations and inspection --------------------------------------------------------------
def test_pop_and_rename_explain_bad_keys() -> None:
    d = rollout(2)
    with pytest.raises(AssertionError, match=r"\['nope'\].*mask"):
        d.pop(batch_keys=["nope"])
    assert set(d.batch.keys()) == {"ids", "mask"}  # nothing was removed
    only_rows = DataProto.from_dict(non_tensors={"uid": object_array(["a"])})
    assert only_rows.pop(non_tensor_batch_keys=["uid"]).non_tensor_batch["uid"].tolist() == ["a"]
    with pytest.raises(TypeError, match="old_keys must be a list or a string"):
        d.rename()
    with pytest.raises(DatasetError, match="same length"):
        d.rename(["ids", "mask"], "x")
    with pytest.raises(DataProtoError, match="no tensor batch"):
        only_rows.rename("a", "b")


def test_get_data_info_describes_every_part() -> None:
    info = rollout(2, {"metrics": [{"t": 1.0}], "shape": (2, 3)}).get_data_info().splitlines()
    assert info[0] == "batch" and "  ids: (2, 2) (torch.int64) cpu" in info
    assert "  uid: ndarray(2,) (object)" in info
    assert "  metrics: list[dict[str: float]]" in info and "  shape: tuple(int, int)" in info


# ---- serialization and futures -----------------------------------------------------------------
def test_serialized_tensors_come_back_exact_for_every_dtype() -> None:
    for t in (
        torch.randn(2, 3).bfloat16(), torch.tensor([[True, False]]), torch.zeros(0, 4),
        torch.tensor(3),
    ):
        back = deserialize_single_tensor(serialize_single_tensor(t))
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
    ragged = torch.nested.as_nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    td = TensorDict({"dense": torch.arange(4).reshape(2, 2), "ragged": ragged}, batch_size=[2])
    back = deserialize_tensordict(serialize_tensordict(td))
    assert back.batch_size == td.batch_size and torch.equal(back["dense"], td["dense"])
    assert [len(t) for t in back["ragged"].unbind()] == [2, 3]


def test_data_proto_future_merges_and_dispatches_without_a_cluster(monkeypatch) -> None:
    import ray

    monkeypatch.setattr(ray, "get", lambda refs: list(refs))  # the "refs" are the parts themselves
    future = DataProtoFuture.concat([rollout(2, {"step": 1}), rollout(2, {"step": 1})])
    assert len(future.get()) == 4
    second = future.chunk(2)[1].get()
    assert second.batch["ids"][:, 0].tolist() == [0, 1] and second.meta_info == {"step": 1}
    tds = DataProtoFuture.concat(
        [TensorDict({"a": torch.ones(1)}, [1]), TensorDict({"a": torch.zeros(1)}, [1])]
    )
    assert tds.get()["a"].tolist() == [1.0, 0.0]


def test_all_gather_on_a_single_rank_group_keeps_the_rows(tmp_path) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        d = rollout(3)
        all_gather_data_proto(d)
        assert uids(d) == ["q0", "q1", "q2"] and d.batch["ids"][:, 0].tolist() == [0, 1, 2]
    finally:
        dist.destroy_process_group()
