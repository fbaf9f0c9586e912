"""Every config file we ship loads under the start-up config check as
``agentloop rollout --config FILE`` loads it: no error and not one warning from any agentloop logger
(the model path is the tiny model's)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agentloop.cli.rollout import build_config
from agentloop.config import resolve_config
from agentloop.configcheck import reset_warnings
from agentloop.testing.tiny_model import ensure_tiny_model

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(
    {
        p.resolve()
        for pattern in ("examples/*/config*.yaml", "agentloop/configs/*.yaml", "configs/*.yaml",
                        "examples/environments/*.yaml")
        for p in REPO.glob(pattern)
        # tool configs and agent-loop lists, not rollout configs
        if not p.name.endswith(("_tools.yaml", "_agents.yaml", "_envs.yaml"))
    }
)


def test_the_shipped_configs_are_found():
    names = {str(p.relative_to(REPO)) for p in SHIPPED}
    assert {"agentloop/configs/rollout.yaml", "agentloop/configs/cpu_train.yaml",
            "examples/quickstart/config.yaml", "examples/environments/skyrl_gym.yaml",
            "examples/environments/mcp.yaml"} <= names
    assert len([n for n in names if n.startswith("examples/")]) >= 3


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(REPO)))
def test_a_shipped_config_loads_without_errors_or_warnings(path, caplog, monkeypatch):
    monkeypatch.chdir(REPO)  # the examples name their tool / agent files relative to the repository
    # warnings are logged once per process: a test before this one must not hide one
    reset_warnings()
    cfg = build_config(str(path), [f"actor_rollout_ref.model.path={ensure_tiny_model()}"])
    with caplog.at_level(logging.WARNING):
        resolved = resolve_config(cfg)
    warnings = [r.getMessage() for r in caplog.records
                if r.name.partition(".")[0] == "agentloop" and r.levelno >= logging.WARNING]
    assert warnings == []
    assert resolved.model_config.path == str(ensure_tiny_model())
