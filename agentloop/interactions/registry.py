"""Loading interactions from YAML (verl's ``interaction_config_path`` format).

    interaction:
      - name: grader
        class_name: agentloop.interactions.answer_check.AnswerCheckInteraction
        config: {max_attempts: 2}

A sample picks one with ``extra_info.interaction_kwargs.name``.  Bad entries fail at start-up with the file
and entry named.
"""

from __future__ import annotations

from pathlib import Path

from agentloop.errors import ConfigError
from agentloop.imports import import_subclass, load_yaml_entries
from agentloop.interactions.base import BaseInteraction


def initialize_interactions_from_config(path: str | Path) -> dict[str, BaseInteraction]:
    """name → interaction instance, for every entry of the YAML file."""
    path = Path(path).expanduser()
    entries = load_yaml_entries(path, "interaction", "interaction_config_path")
    out: dict[str, BaseInteraction] = {}
    for i, entry in enumerate(entries):
        where = f"{path} interaction[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise ConfigError(f"{where}: needs a 'class_name'")
        cls = import_subclass(str(entry["class_name"]), BaseInteraction, f"{where} class_name")
        name = str(entry.get("name") or cls.__name__)
        if name in out:
            raise ConfigError(f"{where}: duplicate interaction name {name!r}")
        out[name] = cls({**(entry.get("config") or {}), "name": name})
    return out
