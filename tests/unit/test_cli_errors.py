"""The CLI's bad-input contract: one line ``agentloop: error: ...``, exit 2, nothing started;
exit 3 on failed runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentloop.cli.failures import EXIT_BAD_INPUT, EXIT_OK, EXIT_TOO_MANY_FAILURES, failure_verdict
from agentloop.cli.rollout import main, one_line
from agentloop.errors import ConfigError

AGENTLOOP = Path(sys.executable).parent / "agentloop"
# what a started Ray or engine would print (ray.init, the manager, vLLM)
STARTED = (
    "Started a local Ray instance", "ray.init", "Traceback", "AgentLoopManager", "vLLM", "INFO",
)


def run_cli(*args: str, module: bool = False) -> subprocess.CompletedProcess[str]:
    """The installed ``agentloop`` command (or ``python -m agentloop.cli.rollout``) in a fresh
    process."""
    cmd = [sys.executable, "-m", "agentloop.cli.rollout"] if module else [str(AGENTLOOP)]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120, env=env)


def assert_one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr
    assert proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith("agentloop: error: ")
    assert not any(marker in proc.stderr for marker in STARTED), proc.stderr
    return line


@pytest.mark.skipif(
    not AGENTLOOP.is_file(), reason="the agentloop console script is not installed in this venv"
)
def test_unknown_key_is_one_line_with_the_suggestion_and_nothing_starts(model_dir, dataset):
    proc = run_cli(
        "rollout", f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={dataset}",
        "actor_rollout_ref.rollout.temprature=0.5",
    )
    line = assert_one_error_line(proc)
    assert (
        "actor_rollout_ref.rollout.temprature (did you mean "
        "actor_rollout_ref.rollout.temperature?)" in line
    )
    assert "strict_config=false" in line  # the escape hatch is named


def test_malformed_prompt_row_is_named_by_file_and_row(model_dir, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "fine"}]}] * 4 + [{"prompt": "What is 2+2?"}]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run_cli(
        "rollout", f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={path}",
        module=True,
    )
    line = assert_one_error_line(proc)
    assert line == (
        f"agentloop: error: {path} row 4 (line 5): prompt must be a list of "
        f"{{role, content}} messages, "
        'got str "What is 2+2?"'
    )


@pytest.mark.parametrize(
    "override,expected",
    [
        (
            "actor_rollout_ref.rollout.temperature=hot",
            'actor_rollout_ref.rollout.temperature="hot" (str): expected a number >= 0',
        ),
        (
            "data.train_files=/nonexistent/train.parquet",
            "dataset file '/nonexistent/train.parquet' does not exist",
        ),
        (
            "actor_rollout_ref.rollout.agent.max_failure_fraction=2",
            "agent.max_failure_fraction=2 (int): expected null or a number in [0, 1]",
        ),
        (
            "actor_rollout_ref.rollout.top_p=[",
            "cannot apply the override 'actor_rollout_ref.rollout.top_p=['",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(model_dir, dataset, capsys, override, expected):
    with pytest.raises(SystemExit) as e:
        main(
            [
                "rollout", f"actor_rollout_ref.model.path={model_dir}",
                f"data.train_files={dataset}", override,
            ]
        )
    assert e.value.code == EXIT_BAD_INPUT
    out = capsys.readouterr()
    (line,) = out.err.splitlines()
    assert line.startswith("agentloop: error: ") and expected in line
    assert out.out == ""


def test_missing_config_file_and_malformed_yaml(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor_rollout_ref: [unclosed\n")
    for path, expected in (
        (tmp_path / "none.yaml", "does not exist"),
        (bad, "is not a valid YAML config"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["rollout", "--config", str(path)])
        assert e.value.code == EXIT_BAD_INPUT
        (line,) = capsys.readouterr().err.splitlines()
        assert expected in line


def test_agentloop_errors_wrapped_by_ray_are_unwrapped_and_others_keep_their_traceback(
    monkeypatch, capsys
):
    import agentloop.cli.rollout as cli

    class RayTaskError(Exception):  # Ray's wrapper: the original exception is .cause
        def __init__(self, cause: BaseException) -> None:
            super().__init__(
                f"ray::AgentLoopWorker.start() (pid=1, ip=10.0.0.1)\nTraceback ...\n{cause!r}"
            )
            self.cause = cause

    def fail(cfg, **kwargs):
        raise RayTaskError(
            ConfigError("tool config 'x.yaml' does not exist: fix multi_turn.tool_config_path")
        )

    monkeypatch.setattr(cli, "run_rollout", fail)
    with pytest.raises(SystemExit) as e:
        main(["rollout"])
    assert e.value.code == EXIT_BAD_INPUT
    assert capsys.readouterr().err == ("agentloop: error: tool config 'x.yaml' does not exist: fix "
                                       "multi_turn.tool_config_path\n")

    def crash(cfg, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(cli, "run_rollout", crash)
    # not turned into exit 2: the console script prints the traceback
    with pytest.raises(ZeroDivisionError):
        main(["rollout"])


def test_one_line_joins_multi_line_messages():
    assert one_line("invalid config values:\n  a=1: bad\n  b=2: bad\nFix them.") == (
        "invalid config values: a=1: bad; b=2: bad; Fix them.")


def test_failure_verdict_exit_code_and_most_common_errors():
    statuses = ["error"] * 5 + ["timeout"] * 2 + ["stop", "tool_error", "parse_error"]
    errors = ["ServerError: server 1 died"] * 3 + ["KeyError: 'x'"] * 2 + [
        "agent loop 'a' exceeded sample_timeout=5s", None, None, "tool failed", None]
    verdict = failure_verdict(statuses, errors, 0.5)
    assert verdict.exit_code == EXIT_TOO_MANY_FAILURES and (
        verdict.num_failed,
        verdict.num_rows,
    ) == (7, 10)
    lines = verdict.message.splitlines()
    assert lines[0].startswith("7 of 10 rows failed (error: 5, timeout: 2), more than "
                               "actor_rollout_ref.rollout.agent.max_failure_fraction=0.5")
    assert lines[1:4] == ["  3 x [error] ServerError: server 1 died", "  2 x [error] KeyError: 'x'",
                          # top 3, most common first
                          "  1 x [timeout] agent loop 'a' exceeded sample_timeout=5s"]
    assert "null" in lines[-1]  # how to accept such runs


@pytest.mark.parametrize("fraction,failed,expected", [
    (0.5, 5, EXIT_OK),  # exactly the fraction: not more than it
    (0.5, 6, EXIT_TOO_MANY_FAILURES),
    (0.0, 1, EXIT_TOO_MANY_FAILURES),  # 0: any failed row fails the run
    (0.0, 0, EXIT_OK),
    (1.0, 10, EXIT_OK),
    (None, 10, EXIT_OK),  # null: never
])
def test_failure_verdict_threshold(fraction, failed, expected):
    statuses = ["error"] * failed + ["length"] * (10 - failed)
    verdict = failure_verdict(statuses, [None] * 10, fraction)
    assert verdict.exit_code == expected
    assert (verdict.message is None) == (expected == EXIT_OK)


def test_policy_statuses_never_count_as_failures():
    statuses = ["tool_error", "parse_error", "max_turns", "length"]
    assert failure_verdict(statuses, ["x"] * 4, 0.0).exit_code == EXIT_OK


def test_rollout_with_mostly_failed_rows_writes_outputs_and_exits_3(
    model_dir, dataset, tmp_path, monkeypatch, capsys
):
    """The whole CLI path after generation (engines replaced by a finished output whose rows
    mostly failed)."""
    import numpy as np
    import torch
    from tensordict import TensorDict

    import agentloop.cli.rollout as cli
    import agentloop.tokenization.loader
    from agentloop.batch.protocol import DataProto

    def fake_generate(cfg, batch, log_file=None):
        n = len(batch)
        ids = torch.ones(n, 2, dtype=torch.long)
        tensors = {
            "prompts": ids, "responses": ids, "input_ids": torch.cat([ids, ids], 1),
            "attention_mask": torch.ones(n, 4, dtype=torch.long), "response_mask": torch.ones(n, 2),
        }
        statuses = ["error", "error", "stop"]
        errors = ["ServerError: server 0 died", "ServerError: server 0 died", None]
        nt = {"status": np.array(statuses, dtype=object), "error": np.array(errors, dtype=object),
              "__num_turns__": np.array([2] * n, dtype=object)}
        return DataProto(
            batch=TensorDict(tensors, batch_size=[n]), non_tensor_batch=nt, meta_info={}
        ), 1.0

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return "x" * len(ids)

    monkeypatch.setattr(cli, "_generate", fake_generate)
    monkeypatch.setattr(agentloop.tokenization.loader, "load_tokenizer", lambda model: Tok())
    out_dir = tmp_path / "out"
    args = ["rollout", f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={dataset}",
            f"output_dir={out_dir}"]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == EXIT_TOO_MANY_FAILURES
    err = capsys.readouterr().err
    assert err.startswith("agentloop: error: 2 of 3 rows failed (error: 2)")
    assert "  2 x [error] ServerError: server 0 died" in err
    assert json.loads((out_dir / "summary.json").read_text())["failed_rows"] == 2
    # the outputs are all there
    assert len((out_dir / "trajectories.jsonl").read_text().splitlines()) == 3
    with pytest.raises(SystemExit) as e:  # a looser threshold accepts the same run
        main([*args, "actor_rollout_ref.rollout.agent.max_failure_fraction=0.7"])
    assert e.value.code == EXIT_OK
