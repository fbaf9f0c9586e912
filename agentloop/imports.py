"""Loading classes named in YAML (``_target_`` / ``class_name``) and YAML entry lists, with clear errors."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import OmegaConf

from agentloop.errors import ConfigError

T = TypeVar("T")


def import_subclass(path: str, base: type[T], where: str) -> type[T]:
    """Import ``pkg.module.Class`` and check it subclasses ``base``; errors name ``where``."""
    module_name, _, attr = str(path).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"{where}: cannot import {path!r}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(f"{where}: {path!r} is not a {base.__name__} subclass")
    return cls


def load_yaml_entries(path: str | Path, key: str | None, label: str) -> list[Any]:
    """The list under ``key`` (or the whole file when ``key`` is None) of a YAML config file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"{label} {str(path)!r} does not exist")
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    entries = data if key is None else (data.get(key) if isinstance(data, dict) else None)
    if not isinstance(entries, list):
        expected = "a YAML list" if key is None else f"a top-level '{key}:' list"
        raise ConfigError(f"{path}: expected {expected}")
    return entries
