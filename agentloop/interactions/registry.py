"""Loading interactions from YAML (verl's ``interaction_config_path`` format).

    interaction:
      - name: grader
        class_name: agentloop.interactions.answer_check.AnswerCheckInteraction
        config: {max_attempts: 2}

A sample picks one with ``extra_info.interaction_kwargs.name``.  Bad entries fail at start-up with the file
and entry named.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from omegaconf import OmegaConf

from agentloop.errors import ConfigError
from agentloop.interactions.base import BaseInteraction


def initialize_interactions_from_config(path: str | Path) -> dict[str, BaseInteraction]:
    """name → interaction instance, for every entry of the YAML file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"interaction_config_path {str(path)!r} does not exist")
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    entries = data.get("interaction") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ConfigError(f"{path}: expected a top-level 'interaction:' list")
    out: dict[str, BaseInteraction] = {}
    for i, entry in enumerate(entries):
        where = f"{path} interaction[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise ConfigError(f"{where}: needs a 'class_name'")
        module_name, _, attr = str(entry["class_name"]).rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise ConfigError(f"{where}: cannot import {entry['class_name']!r}: {e}") from e
        if not (isinstance(cls, type) and issubclass(cls, BaseInteraction)):
            raise ConfigError(f"{where}: {entry['class_name']!r} is not a BaseInteraction subclass")
        name = str(entry.get("name") or cls.__name__)
        if name in out:
            raise ConfigError(f"{where}: duplicate interaction name {name!r}")
        out[name] = cls({**(entry.get("config") or {}), "name": name})
    return out
