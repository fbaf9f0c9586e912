"""Loading tools from a YAML file (verl's ``tool_config_path`` format).

    tools:
      - class_name: agentloop.tools.calculator.CalculatorTool
        config: {type: native, timeout: 5}
        tool_schema: {type: function, function: {name: calculator, ...}}   # optional when the class has one
      - class_name: mypkg.tools.get_weather   # a function decorated with @function_tool
        config: {timeout: 10}

Everything is checked at start-up: a bad class path, a schema that fails validation, or a duplicate
tool name raises :class:`~agentloop.errors.ConfigError` naming the file and the entry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from agentloop.errors import ConfigError
from agentloop.imports import import_subclass, load_yaml_entries
from agentloop.tools.base import BaseTool
from agentloop.tools.schemas import OpenAIFunctionToolSchema

_HINT = "a tool is a BaseTool subclass or a function decorated with @agentloop.tools.function_tool"


def build_tool(entry: dict[str, Any], where: str) -> BaseTool:
    """One tool from one YAML entry."""
    if not isinstance(entry, dict) or "class_name" not in entry:
        raise ConfigError(f"{where}: each tool needs a 'class_name', got {entry!r}")
    cls = import_subclass(str(entry["class_name"]), BaseTool, f"{where} class_name", hint=_HINT)
    config = dict(entry.get("config") or {})
    raw_schema = entry.get("tool_schema")
    try:
        schema = OpenAIFunctionToolSchema.model_validate(raw_schema) if raw_schema is not None else None
    except ValidationError as e:
        raise ConfigError(f"{where}: tool_schema does not validate: {e}") from e
    try:
        return cls(config, schema) if schema is not None else cls(config)  # type: ignore[call-arg]
    except TypeError as e:
        raise ConfigError(f"{where}: {cls.__name__} needs a tool_schema in the YAML entry ({e})") from e


def initialize_tools_from_config(tool_config_path: str | Path) -> list[BaseTool]:
    """All tools of a ``tool_config_path`` YAML, validated."""
    path = Path(tool_config_path).expanduser()
    entries = load_yaml_entries(path, "tools", "tool_config_path")
    tools: list[BaseTool] = []
    for i, entry in enumerate(entries):
        tool = build_tool(entry, f"{path} tools[{i}]")
        if any(t.name == tool.name for t in tools):
            raise ConfigError(f"{path} tools[{i}]: duplicate tool name {tool.name!r}")
        tools.append(tool)
    return tools
