"""Loading interactions from YAML (verl's ``interaction_config_path`` format).

    interaction:
      - name: grader
        class_name: agentloop.interactions.answer_check.AnswerCheckInteraction
        config: {max_attempts: 2}

``class_name`` (verl's key) and ``_target_`` are aliases: an import path, or a name registered with
:func:`register_interaction` (built in: ``answer_check``).
A sample picks one with ``extra_info.interaction_kwargs.name``.  Without ``name`` an entry is named
after its class as verl does: the class name without a trailing ``Interaction``, lower-cased
(``Gsm8kInteraction`` → ``gsm8k``).  Each interaction is built as
``cls(config={**config, "name": name})``. Bad entries fail at start-up with the file and entry
named.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from agentloop.errors import ConfigError
from agentloop.interactions.base import BaseInteraction
from agentloop.utils.imports import load_yaml_entries
from agentloop.utils.registry import Registry, entry_target

_SUFFIX = "Interaction"

INTERACTIONS = Registry(
    "interaction",
    decorator="register_interaction",
    base=BaseInteraction,
    how="Register one with @register_interaction(name) on a BaseInteraction subclass, or "
    "give its import path.",
)
"""Interaction classes by name, for a YAML entry's ``class_name`` / ``_target_``."""
INTERACTIONS.add("answer_check", "agentloop.interactions.answer_check.AnswerCheckInteraction")


def register_interaction(name: str) -> Callable[[type[BaseInteraction]], type[BaseInteraction]]:
    """Class decorator: make a BaseInteraction subclass available as ``class_name: name`` /
    ``_target_: name``.

    Raises:
        ConfigError: not a BaseInteraction subclass, or ``name`` is taken by another interaction
        class.
    """
    return INTERACTIONS.register(name)


def get_interaction_class(cls_name: str) -> type[BaseInteraction]:
    """The interaction class at the dotted path (or registered name) ``cls_name`` (verl's
    helper)."""
    return INTERACTIONS.resolve(str(cls_name), "interaction class_name")


def default_interaction_name(cls_name: str) -> str:
    """verl's name for an entry without one: ``pkg.Gsm8kInteraction`` → ``gsm8k``, ``pkg.Grader``
    → ``grader``."""
    simple = str(cls_name).rsplit(".", 1)[-1]
    return (simple[: -len(_SUFFIX)] if simple.endswith(_SUFFIX) else simple).lower()


def initialize_interactions_from_config(path: str | Path) -> dict[str, BaseInteraction]:
    """name → interaction instance, for every entry of the YAML file."""
    path = Path(path).expanduser()
    entries = load_yaml_entries(path, "interaction", "interaction_config_path")
    out: dict[str, BaseInteraction] = {}
    for i, entry in enumerate(entries):
        where = f"{path} interaction[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: needs a 'class_name' (or '_target_')")
        target = entry_target(entry, where, "needs a 'class_name' (or '_target_')")
        key = "_target_" if entry.get("_target_") is not None else "class_name"
        cls = INTERACTIONS.resolve(target, f"{where} {key}")
        name = str(entry.get("name") or default_interaction_name(target))
        if name in out:
            raise ConfigError(
                f"{where}: duplicate interaction name {name!r}; give each entry its own 'name'"
            )
        out[name] = cls(config={**(entry.get("config") or {}), "name": name})  # type: ignore[call-arg]
    return out
