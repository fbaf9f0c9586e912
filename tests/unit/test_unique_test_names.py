"""Test modules are imported by basename (no packages under tests/): two with one name stop the
collection of the whole suite, so every basename must be unique across tests/."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_basename_is_unique():
    names = Counter(p.name for p in TESTS.rglob("*.py") if p.name != "__init__.py"
                    and p.name != "conftest.py")
    assert [n for n, k in names.items() if k > 1] == []
