"""Loading classes named in YAML (``_target_`` / ``class_name``) and YAML entry lists, with clear
errors."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import OmegaConf

from agentloop.errors import ConfigError

T = TypeVar("T")


def import_subclass(path: str, base: type[T], where: str, hint: str = "") -> type[T]:
    """Import ``pkg.module.Class`` and check it subclasses ``base``; errors name ``where``.

    ``hint`` is appended to the "not a subclass" error (e.g. how to make a plain function fit).
    """
    module_name, _, attr = str(path).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        ported = _verl_equivalent(str(path))
        if ported is None:
            raise ConfigError(f"{where}: cannot import {path!r}: {e}") from e
        return import_subclass(ported, base, where, hint)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(
            f"{where}: {path!r} is not a {base.__name__} subclass{'; ' + hint if hint else ''}"
        )
    return cls


def load_yaml_entries(path: str | Path, key: str | None, label: str) -> list[Any]:
    """The list under ``key`` (or the whole file when ``key`` is None) of a YAML config file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"{label} {str(path)!r} does not exist")
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if key is None:
        entries: Any = data
    elif isinstance(data, dict):
        entries = data.get(key)
    else:
        entries = None
    if not isinstance(entries, list):
        expected = "a YAML list" if key is None else f"a top-level '{key}:' list"
        raise ConfigError(f"{path}: expected {expected}")
    return entries


def import_object(path: str, where: str) -> Any:
    """Import ``pkg.module:attr`` or ``pkg.module.attr``; errors name ``where``."""
    module_name, sep, attr = str(path).partition(":")
    if not sep:
        module_name, _, attr = str(path).rpartition(".")
    try:
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"{where}: cannot import {path!r}: {e}") from e
    return obj


def _verl_equivalent(path: str) -> str | None:
    """agentloop's class for a ``verl.*`` class path in a config (verl's tool / interaction YAML
    names ``verl.tools.gsm8k_tool.Gsm8kTool``) when verl itself is not importable; None otherwise.
    """
    if not path.startswith("verl."):
        return None
    from agentloop.compat.import_map import VERL_IMPORT_MAP  # the verl seam; only for verl paths

    module_name, _, attr = path.rpartition(".")
    for verl_module in sorted(VERL_IMPORT_MAP, key=len, reverse=True):
        if module_name == verl_module:
            return f"{VERL_IMPORT_MAP[verl_module]}.{attr}"
    return None
