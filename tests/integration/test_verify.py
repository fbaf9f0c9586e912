"""``agentloop verify`` and ``agentloop report`` on a real rollout: one vLLM CPU engine (tiny model,
fp32) rolls out calculator problems with ``tool_agent`` through the rollout CLI's own
``run_rollout`` (so the output directory is exactly what ``agentloop rollout`` writes), at
temperature 0.8 with the conversations saved.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentloop.cli.rollout import build_config, main, run_rollout

pytestmark = pytest.mark.integration

TEMPERATURE = 0.8


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out + err


@pytest.fixture(scope="module")
def model_path() -> str:
    from agentloop.testing.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model())


@pytest.fixture(scope="module")
def rollout_dir(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[Path]:
    import ray

    from agentloop.testing.tiny_model import word_problem_rows

    base = tmp_path_factory.mktemp("verify_it")
    rows = word_problem_rows(8, agent_name="tool_agent", data_source="calculator_agent", seed=3)
    (base / "problems.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = base / "out"
    cfg = build_config("examples/calculator_agent/config.yaml", [
        f"actor_rollout_ref.model.path={model_path}", f"data.train_files={base / 'problems.jsonl'}",
        f"output_dir={out}", f"actor_rollout_ref.rollout.temperature={TEMPERATURE}",
        "actor_rollout_ref.rollout.multi_turn.return_messages=true",
        "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.server.num_servers=1",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "custom_reward_function.path=agentloop.rewards.calculator",
        "custom_reward_function.name=compute_score",
    ])
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    try:
        assert run_rollout(cfg) == 0
    finally:
        ray.shutdown()
    # saved by the rollout CLI: verify reads the sampling settings from it
    assert (out / "config.yaml").is_file()
    yield out


def test_verify_passes_on_a_real_rollout(
    rollout_dir: Path, model_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run_cli(["verify", str(rollout_dir), "--model", model_path], capsys)
    print(out)
    assert code == 0, out
    assert f"temperature {TEMPERATURE:g}" in out and "0 tokens over --atol" in out
    assert "8 conversations" in out and " 0 mismatches" in out and "verify: PASSED" in out


def test_verify_fails_on_a_corrupted_log_prob(rollout_dir: Path, tmp_path: Path, model_path: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from agentloop.batch.protocol import DataProto

    data = DataProto.load_from_disk(str(rollout_dir / "rollout.dataproto"))
    assert data.batch is not None
    row, pos = 2, int(data.batch["response_mask"][2].nonzero()[0])
    data.batch["rollout_log_probs"][row, pos] -= 0.05
    data.save_to_disk(str(tmp_path / "rollout.dataproto"))
    (tmp_path / "config.yaml").write_text((rollout_dir / "config.yaml").read_text())
    code, out = run_cli(["verify", str(tmp_path), "--model", model_path], capsys)
    assert code == 3, out
    assert (
        "1 tokens over --atol" in out
        and f"row {row} response position {pos}" in out
        and "FAILED" in out
    )


def test_report_on_a_real_rollout(rollout_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(["report", str(rollout_dir)], capsys)
    assert code == 0, out
    page = (rollout_dir / "report.html").read_text()
    assert "mean reward" in page and "tool-call rate" in page
    assert all(p.stat().st_size > 2000 for p in (rollout_dir / "report").glob("*.png"))
    from agentloop.batch.protocol import DataProto

    calls = DataProto.load_from_disk(str(rollout_dir / "rollout.dataproto")).non_tensor_batch[
        "generate_calls"
    ]
    per_sample = [c for c in calls.tolist() if c]  # on each sample's first trajectory
    assert len(per_sample) == len(calls) == 8  # one sample, one trajectory, its calls
    assert all(
        call["end"] >= call["start"] and call["server"] == 0 for c in per_sample for call in c
    )
