"""Where ``agentloop rollout`` sends the engines' and Ray's logs: to ``<output_dir>/rollout.log`` by
default, to the console with ``--verbose`` (README "The rollout job").

Kept cheap: the model directory passes the start-up check (it has a ``config.json``) but holds no
model, so the vLLM server actor fails as soon as its engine reads it; Ray, the actor and its log
output are real. The two runs go in parallel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

RAY_ACTOR_LOG = ":actor_name:VLLMServer"
"""The line Ray starts an actor's log file with (what rollout.log collects)."""
RAY_CONSOLE_PREFIX = "(VLLMServer pid="
"""The prefix Ray puts on an actor's output that it shows on the driver's console."""
RAY_STARTED = "Started a local Ray instance"
"""Ray's own log line when the driver starts it (at INFO: kept off the console unless --verbose)."""


def start(tmp_path: Path, name: str, *flags: str) -> tuple[subprocess.Popen[str], Path]:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": [{"role": "user", "content": "hi"}]}\n')
    out = tmp_path / name
    cmd = [
        sys.executable, "-m", "agentloop.cli.rollout", "rollout", *flags,
        f"actor_rollout_ref.model.path={model}", f"data.train_files={data}", f"output_dir={out}",
        "actor_rollout_ref.rollout.server.device=cpu",
    ]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    ), out


def test_engine_and_ray_logs_go_to_rollout_log_unless_verbose(tmp_path: Path) -> None:
    quiet, quiet_out = start(tmp_path, "quiet")
    verbose, verbose_out = start(tmp_path, "verbose", "--verbose")
    console = {
        "quiet": quiet.communicate(timeout=300)[0],
        "verbose": verbose.communicate(timeout=300)[0],
    }
    # the server cannot start: no model
    assert quiet.returncode != 0 and verbose.returncode != 0, console

    log = (quiet_out / "rollout.log").read_text()
    assert log.startswith("# agentloop rollout: engine and Ray worker logs")
    assert RAY_ACTOR_LOG in log  # the server actor's own output, copied at the end of the run
    # ... and kept off the console, as are Ray's own logs
    assert RAY_CONSOLE_PREFIX not in console["quiet"]
    assert RAY_STARTED not in console["quiet"]
    assert "agentloop: error:" in console["quiet"]  # the run's own error still is on it

    assert (verbose_out / "config.yaml").is_file()  # the run got as far as the quiet one
    assert not (verbose_out / "rollout.log").exists()  # --verbose: the logs stay on the console
    assert RAY_STARTED in console["verbose"], console["verbose"]
