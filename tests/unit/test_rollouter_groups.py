"""The one grouping helper (generate_sequences_stream and the Rollouter): prompts of different
batches (different weight versions) can be dispatched together."""

from __future__ import annotations

from agentloop.batch.data import repeat_for_rollout, rows_to_batch
from agentloop.batch.protocol import DataProto
from agentloop.rollout.dispatcher import split_groups


def test_groups_keep_rows_of_a_uid_together_and_drop_the_batch_version():
    batch = repeat_for_rollout(
        rows_to_batch([{"prompt": [{"role": "user", "content": f"q{i}"}]} for i in range(3)]), 2
    )
    batch.meta_info["global_steps"] = 4
    groups = split_groups(batch, "uid")
    assert [len(g) for g in groups] == [2, 2, 2]
    assert all(len(set(g.non_tensor_batch["uid"].tolist())) == 1 for g in groups)
    later = rows_to_batch([{"prompt": [{"role": "user", "content": "q9"}]}])
    later.meta_info["global_steps"] = 5
    # would conflict on global_steps otherwise
    mixed = DataProto.concat([groups[0], *split_groups(later, "uid")])
    assert len(mixed) == 3 and "global_steps" not in mixed.meta_info
    assert batch.meta_info["global_steps"] == 4  # the caller's batch is left as it is
    assert [len(g) for g in split_groups(batch, None)] == [1] * 6


def test_the_default_in_flight_budget_fills_every_engine():
    from types import SimpleNamespace

    from agentloop.config import EngineConfig
    from agentloop.rollout.rollouter import Rollouter

    engine = EngineConfig.from_root({"actor_rollout_ref": {"rollout": {"max_num_seqs": 256}}})
    manager = SimpleNamespace(server_handles=[object()] * 8, config=SimpleNamespace(engine=engine))
    assert Rollouter(manager, []).max_inflight == 8 * 256  # servers x max_num_seqs, not a fixed 64
    assert Rollouter(manager, [], max_inflight=5).max_inflight == 5
