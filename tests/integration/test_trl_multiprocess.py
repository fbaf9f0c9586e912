"""TRL 1.16's GRPOTrainer with ``AgentLoopRollout`` under 2 CPU processes (torchrun, DDP on gloo),
on the scripted engine (trl_ddp_rank.py): each rank's ``rollout_func`` rolls out its own slice of
the prompts and training steps on both ranks. ``sync_ranks="all"``: each rank has its own manager
and streams into it. ``sync_ranks="main"``: the ranks' managers share one server on one Ray
cluster; rank 0 streams, rank 1 waits for it, and both ranks' next rollouts run on the new
weights. docs/trl.md#multi-process-accelerate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("trl")

RANK_SCRIPT = Path(__file__).resolve().parent / "trl_ddp_rank.py"
STEPS = 2
"""Optimizer steps (one rollout each: 4 samples per rank)."""


def launch(out: Path, sync_ranks: str, group: int) -> list[dict[str, Any]]:
    """Run trl_ddp_rank.py on 2 processes; returns each rank's record (rank 0 first)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               TRL_EXPERIMENTAL_SILENCE="1", RAY_AUTH_MODE="disabled")
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", str(RANK_SCRIPT), str(out),
         sync_ranks, str(group)],
        env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_each_rank_rolls_out_its_own_prompts_and_syncs_its_own_manager(tmp_path: Path) -> None:
    ranks = launch(tmp_path, "all", group=4)
    seen: list[set[str]] = []
    for rank, record in enumerate(ranks):
        assert record["rank"] == rank and record["world_size"] == 2
        assert record["global_step"] == STEPS and record["samples"] == 4 * STEPS
        assert len(record["rollouts"]) == STEPS
        for call, rollout in enumerate(record["rollouts"]):
            # one problem per rank per rollout (a whole group of 4), its uid by global position
            assert len(set(rollout["prompts"])) == 1 and len(rollout["prompts"]) == 4
            assert rollout["uids"] == [f"trl{call}-{rank}"] * 4
            assert rollout["versions"] == [call] * 4  # on the weights of the step before
        seen.append({p for rollout in record["rollouts"] for p in rollout["prompts"]})
        # every rank streamed the weights into its own manager after each step
        assert [u["step"] for u in record["updates"]] == list(range(1, STEPS + 1))
        assert record["updates"][-1]["checksum"] == record["final_checksum"]
        assert record["final_checksum"] != record["start_checksum"]  # training stepped
    assert not seen[0] & seen[1]  # each rank had prompts of its own
    assert ranks[0]["updates"] == ranks[1]["updates"]  # DDP: the same weights on both ranks


def test_ranks_sharing_one_server_sync_from_the_main_process_only(tmp_path: Path) -> None:
    """A group of 8 split between the ranks keeps one uid; rank 1 syncs nothing, yet its next
    rollout runs on the weights rank 0 streamed (it waited for the sync)."""
    ranks = launch(tmp_path, "main", group=8)
    for call in range(STEPS):
        first, second = (record["rollouts"][call] for record in ranks)
        # one group of 8 split between the ranks: the same problem and uid on both
        assert len(first["prompts"]) == len(second["prompts"]) == 4
        assert set(first["prompts"]) == set(second["prompts"])
        assert first["uids"] == second["uids"] == [f"trl{call}-0"] * 4
        assert first["versions"] == second["versions"] == [call] * 4
    assert [u["step"] for u in ranks[0]["updates"]] == list(range(1, STEPS + 1))
    assert ranks[1]["updates"] == []
    assert ranks[0]["updates"][-1]["checksum"] == ranks[1]["final_checksum"]
    assert ranks[0]["final_checksum"] == ranks[1]["final_checksum"] != ranks[0]["start_checksum"]
