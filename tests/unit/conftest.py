"""Fixtures shared by the unit tests: a model directory and a dataset for the config and the CLI,
the tiny model's tokenizer for the tests that encode chats."""

from __future__ import annotations

import json

import pytest

from agentloop.loops.base import _agent_loop_registry  # verl's name for the users' loop registry
from agentloop.testing.tiny_model import ensure_tiny_model


@pytest.fixture
def model_dir(tmp_path):
    """A directory that passes the model-path check (a config.json), without weights: nothing
    loads it."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


@pytest.fixture
def dataset(tmp_path):
    """Three verl-format rows (a chat prompt each) in a JSONL file."""
    path = tmp_path / "train.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": [{"role": "user", "content": f"q{i}"}]}) + "\n" for i in range(3)
        )
    )
    return path


@pytest.fixture(scope="session")
def tokenizer():
    """The tiny model's tokenizer (a Qwen-style chat template), loaded once per run; a module may
    define its own."""
    from transformers import AutoTokenizer  # heavy: only for the tests that ask for it

    return AutoTokenizer.from_pretrained(str(ensure_tiny_model()))


@pytest.fixture(autouse=True, scope="module")
def _loops_registered_only_while_their_module_runs():
    """A loop a test module registers (``@register`` in a test) is unregistered when the module
    ends: Ray workers of later (integration) tests cannot import test modules, and the manager ships
    the driver's registry to them."""
    before = set(_agent_loop_registry)
    yield
    for name in set(_agent_loop_registry) - before:
        _agent_loop_registry.pop(name, None)
