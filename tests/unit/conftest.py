"""Fixtures shared by the unit tests of the config and the CLI."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def model_dir(tmp_path):
    """A directory that passes the model-path check (a config.json), without weights: nothing loads it."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


@pytest.fixture
def dataset(tmp_path):
    """Three verl-format rows (a chat prompt each) in a JSONL file."""
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"q{i}"}]}) + "\n" for i in range(3)))
    return path
