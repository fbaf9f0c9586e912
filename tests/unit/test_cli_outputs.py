"""What ``agentloop rollout`` writes for a user to read afterwards: rewards in trajectories.jsonl
and summary.json, token counts that say what they count, no stale report, layered ``--config``
files."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import agentloop.cli.rollout as cli
import agentloop.tokenization.loader
from agentloop.batch.protocol import DataProto
from agentloop.cli.failures import EXIT_OK
from agentloop.cli.rollout import build_config, cli_name, main
from agentloop.errors import ConfigError


def fake_generate(cfg, batch, log_file=None):
    """Three rows of 4 response tokens: the middle two are a tool result (mask 0); rewards 1, 0
    and none."""
    n = len(batch)
    ids = torch.ones(n, 4, dtype=torch.long)
    mask = torch.tensor([[1, 0, 0, 1]] * n, dtype=torch.float32)
    scores = torch.zeros(n, 4)
    scores[0, 3] = 1.0
    tensors = {
        "prompts": ids[:, :2], "responses": ids, "input_ids": torch.cat([ids[:, :2], ids], 1),
        "attention_mask": torch.ones(n, 6, dtype=torch.long), "response_mask": mask,
        "rm_scores": scores,
    }
    nt = {"status": np.array(["stop", "stop", "error"], dtype=object),
          "error": np.array([None, None, "ToolError: boom"], dtype=object),
          "__num_turns__": np.array([3] * n, dtype=object),
          "reward_valid": np.array([True, True, False], dtype=object)}
    return DataProto(
        batch=TensorDict(tensors, batch_size=[n]), non_tensor_batch=nt, meta_info={}
    ), 2.0


@pytest.fixture
def rollout(model_dir, dataset, tmp_path, monkeypatch):
    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return "x" * len(ids)

    monkeypatch.setattr(cli, "_generate", fake_generate)
    monkeypatch.setattr(agentloop.tokenization.loader, "load_tokenizer", lambda model: Tok())
    out_dir = tmp_path / "out"

    def run() -> None:
        with pytest.raises(SystemExit) as e:
            main(
                [
                    "rollout", f"actor_rollout_ref.model.path={model_dir}",
                    f"data.train_files={dataset}", f"output_dir={out_dir}",
                    "actor_rollout_ref.rollout.agent.max_failure_fraction=0.9",
                ]
            )
        assert e.value.code == EXIT_OK

    return out_dir, run


def test_each_trajectory_line_and_the_summary_carry_the_reward(rollout):
    out_dir, run = rollout
    run()
    lines = [json.loads(line) for line in (out_dir / "trajectories.jsonl").read_text().splitlines()]
    # no reward: null, not a made-up 0
    assert [line["reward"] for line in lines] == [1.0, 0.0, None]
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["reward"] == {"mean": 0.5, "min": 0.0, "max": 1.0, "rows_scored": 2}
    # sampled tokens (what the console's tok/s counts) apart from all response tokens (tool results
    # included)
    assert summary["sampled_tokens"] == 6 and summary["response_tokens"] == 12
    assert summary["sampled_tokens_per_s"] == 3.0 and summary["response_tokens_per_s"] == 6.0


def test_a_report_of_an_earlier_run_in_the_same_directory_is_removed(rollout):
    out_dir, run = rollout
    (out_dir / "report").mkdir(parents=True)
    (out_dir / "report" / "lengths.png").write_bytes(b"old")
    (out_dir / "report.html").write_text("<html>an earlier run</html>")
    (out_dir / "notes.txt").write_text("the user's own file")
    run()
    assert not (out_dir / "report.html").exists() and not (out_dir / "report").exists()
    assert (out_dir / "notes.txt").read_text() == "the user's own file" and (
        out_dir / "summary.json"
    ).is_file()


def test_several_config_files_layer_in_order(tmp_path):
    task, preset = tmp_path / "task.yaml", tmp_path / "preset.yaml"
    task.write_text(
        "data:\n  train_files: t.jsonl\nactor_rollout_ref:\n  rollout:\n    temperature: 0.3\n"
    )
    preset.write_text("actor_rollout_ref:\n  rollout:\n    temperature: 0.9\n    top_p: 0.5\n")
    cfg = build_config([str(task), str(preset)], ["actor_rollout_ref.rollout.top_p=0.7"])
    # before, a second --config replaced the first: data.train_files was lost
    assert cfg.data.train_files == "t.jsonl" and cfg.actor_rollout_ref.rollout.temperature == 0.9
    assert cfg.actor_rollout_ref.rollout.top_p == 0.7
    with pytest.raises(ConfigError, match="missing.yaml"):
        build_config([str(task), str(tmp_path / "missing.yaml")], [])


def test_the_command_line_takes_config_twice(tmp_path, monkeypatch):
    task, preset = tmp_path / "task.yaml", tmp_path / "preset.yaml"
    task.write_text("data:\n  train_files: t.jsonl\n")
    preset.write_text("actor_rollout_ref:\n  rollout:\n    temperature: 0.9\n")
    seen = {}
    monkeypatch.setattr(cli, "run_rollout", lambda cfg, **kw: seen.setdefault("cfg", cfg) and 0)
    with pytest.raises(SystemExit):
        main(["rollout", "--config", str(task), "--config", str(preset)])
    assert (
        seen["cfg"].data.train_files == "t.jsonl"
        and seen["cfg"].actor_rollout_ref.rollout.temperature == 0.9
    )


def test_the_next_step_hint_names_a_command_that_runs(tmp_path, monkeypatch):
    """`make demo` runs .venv/bin/agentloop with the venv not activated: the hint must not say a
    bare `agentloop` the shell cannot find."""
    import shutil
    import sys

    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "agentloop").write_text("#!/bin/sh\n")
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert cli_name() == ".venv/bin/agentloop"
    # on PATH: the short name
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/local/bin/agentloop")
    assert cli_name() == "agentloop"
