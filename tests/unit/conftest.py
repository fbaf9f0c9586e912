"""Fixtures shared by the unit tests: a model directory and a dataset for the config and the CLI, the tiny model's
tokenizer for the tests that encode chats."""

from __future__ import annotations

import json

import pytest

from agentloop.testing.tiny_model import ensure_tiny_model


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


@pytest.fixture(scope="session")
def tokenizer():
    """The tiny model's tokenizer (a Qwen-style chat template), loaded once per run; a module may define its own."""
    from transformers import AutoTokenizer  # heavy: only for the tests that ask for it

    return AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
