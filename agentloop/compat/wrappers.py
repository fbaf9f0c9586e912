"""verl's wrapper objects for values handed to agent-loop constructors.

verl builds loops with ``hydra.utils.instantiate``, which would turn a DictConfig or a list of tools
passed as a keyword into a recursively resolved copy; verl therefore wraps them.  agentloop does not
use Hydra per sample, but keeps the wrappers so a verl loop reads ``trainer_config.config`` and
``tools.tools`` exactly as it does under verl.
"""

from __future__ import annotations

from typing import Any


class DictConfigWrap:
    """Holds a config as ``.config`` (verl: ``trainer_config`` and ``data_config`` arrive
    wrapped)."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def __repr__(self) -> str:
        return f"DictConfigWrap(keys={list(self.config) if hasattr(self.config, 'keys') else '?'})"


class ToolListWrap:
    """Holds the worker's tool objects as ``.tools`` (verl 0.9 passes ``tools=ToolListWrap(...)``
    to loops)."""

    def __init__(self, tools: list[Any]) -> None:
        self.tools = list(tools)

    def __repr__(self) -> str:
        return f"ToolListWrap({[getattr(t, 'name', t) for t in self.tools]})"
