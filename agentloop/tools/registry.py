"""Loading tools from a YAML file (verl's ``tool_config_path`` format) and from a Python file.

    tools:
      - class_name: agentloop.tools.calculator.CalculatorTool
        config: {type: native, timeout: 5}
        tool_schema: {type: function, function: {name: calculator, ...}}   # optional when the class
        has one
      - class_name: mypkg.tools.get_weather   # a function decorated with @function_tool
        config: {timeout: 10}
      - _target_: calculator                   # a registered tool name (_target_ = class_name)

``class_name`` (verl's key) and ``_target_`` are aliases: an import path, or a name registered with
:func:`register_tool` (built in: ``calculator``, ``calc_gsm8k_reward``, ``delete_context``,
``summarize_context``) or with ``@function_tool`` (``FUNCTION_TOOLS``, which :data:`TOOLS` consults
for names it lacks: one lookup for both).

``config.type`` is optional: ``native`` (the default) or ``mcp`` (verl's MCP entries: every tool of
the MCP servers the entry's ``mcp:`` block names, see :mod:`agentloop.tools.mcp`).
:func:`load_all_tools` is verl 0.9.1's entry point: the YAML's tools, then the ``@function_tool``
functions of ``function_tool_path`` (a Python file, see
:func:`~agentloop.tools.function_tool.load_function_tools_from_path`).

Everything is checked at start-up: a bad class path, an invalid schema or a duplicate tool name
(also between the two sources) raises :class:`~agentloop.errors.ConfigError` naming the file and the
entry.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from agentloop.errors import ConfigError
from agentloop.tools.base import BaseTool
from agentloop.tools.function_tool import (
    FUNCTION_TOOLS,
    FunctionTool,
    load_function_tools_from_path,
)
from agentloop.tools.mcp import (
    VERL_MCP_CLASSES,
    MCPTool,
    check_mcp_class,
    import_mcp,
    load_mcp_tools,
    load_server_specs,
)
from agentloop.tools.schemas import OpenAIFunctionToolSchema
from agentloop.utils.imports import load_yaml_entries
from agentloop.utils.registry import Registry, entry_target

_HINT = "a tool is a BaseTool subclass or a function decorated with @agentloop.tools.function_tool"

TOOLS = Registry(
    "tool",
    decorator="register_tool",
    base=BaseTool,
    fallback=FUNCTION_TOOLS,
    how="Register one with @register_tool(name) on a BaseTool subclass (or @function_tool "
    "on a function), "
    "or give its import path.",
)
"""Tool classes by name, for a YAML entry's ``class_name`` / ``_target_``; built-ins imported on
first use. Names registered here come first, then the ``@function_tool`` tools of its fallback
``FUNCTION_TOOLS``."""
for _name, _path in {
    "calculator": "calculator.CalculatorTool", "calc_gsm8k_reward": "gsm8k.Gsm8kTool",
    "delete_context": "context_tools.DeleteContextTool",
    "summarize_context": "context_tools.SummarizeContextTool",
}.items():
    TOOLS.add(_name, f"agentloop.tools.{_path}")


def register_tool(name: str) -> Callable[[type[BaseTool]], type[BaseTool]]:
    """Class decorator: make a BaseTool subclass available as ``class_name: name`` /
    ``_target_: name``.

    Raises:
        ConfigError: not a BaseTool subclass, or ``name`` is taken by another tool class.
    """
    return TOOLS.register(name)


def tool_class(spec: str, where: str = "tool class_name") -> type[BaseTool]:
    """The tool class for ``spec``: a registered name (:func:`register_tool`, ``@function_tool``) or
    an import path.  Raises ConfigError (prefixed by ``where``) for an unknown name or a bad path.
    """
    spec = str(spec)
    # "a:b" too is an unknown name here, not an import path
    if spec not in TOOLS and "." not in spec:
        raise ConfigError(f"{where}: {TOOLS.unknown_message(spec)}")
    return TOOLS.resolve(spec, where, hint=_HINT)


def get_tool_class(cls_name: str) -> type[BaseTool]:
    """The tool class at the dotted path (or registered name) ``cls_name`` (verl's helper)."""
    return tool_class(cls_name)


def build_tool(entry: dict[str, Any], where: str) -> BaseTool:
    """One tool from one YAML entry."""
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: each tool needs a 'class_name' (or '_target_'), got {entry!r}")
    target = entry_target(
        entry, where, f"each tool needs a 'class_name' (or '_target_'), got {entry!r}"
    )
    key = "_target_" if entry.get("_target_") is not None else "class_name"
    cls = tool_class(target, f"{where} {key}")
    config = dict(entry.get("config") or {})
    if config.get("type", "native") != "native":
        raise ConfigError(
            f"{where}: config.type {config['type']!r} is not supported; "
            f"agentloop loads native "
            "tools (type: native, or leave it out) and MCP servers (type: mcp)"
        )
    raw_schema = entry.get("tool_schema")
    try:
        schema = (
            OpenAIFunctionToolSchema.model_validate(raw_schema) if raw_schema is not None else None
        )
    except ValidationError as e:
        raise ConfigError(f"{where}: tool_schema does not validate: {e}") from e
    try:
        return cls(config, schema) if schema is not None else cls(config)  # type: ignore[call-arg]
    except TypeError as e:
        raise ConfigError(
            f"{where}: {cls.__name__} needs a tool_schema in the YAML entry ({e})"
        ) from e
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from e


def build_mcp_tools(entry: dict[str, Any], where: str, base_dir: Path) -> list[BaseTool]:
    """The tools of one ``config.type: mcp`` entry (:func:`agentloop.tools.mcp.load_mcp_tools`);
    ``class_name`` / ``_target_`` is optional: verl's MCP classes mean :class:`MCPTool`, anything
    else must resolve to an MCPTool subclass."""
    target = entry.get("_target_") or entry.get("class_name")
    cls: type[MCPTool] = MCPTool
    if target is not None and str(target) not in VERL_MCP_CLASSES:
        key = "_target_" if entry.get("_target_") is not None else "class_name"
        cls = check_mcp_class(tool_class(str(target), f"{where} {key}"), str(target), where)
    return list(load_mcp_tools(entry, where, cls, base_dir))


def check_tool_config(tool_config_path: str | Path | None) -> None:
    """What can be checked of a tool YAML without starting anything, for the driver before any
    engine starts: the ``type: mcp`` entries' servers (unknown names, a server without ``command``
    or ``url``, a missing servers file), their class and the mcp SDK. None: nothing to check.

    Raises:
        ConfigError: the first problem found, naming the file and the entry.
    """
    if not tool_config_path:
        return
    path = Path(tool_config_path).expanduser()
    for i, entry in enumerate(load_yaml_entries(path, "tools", "tool_config_path")):
        if not _is_mcp(entry):
            continue
        where = f"{path} tools[{i}]"
        target = entry.get("_target_") or entry.get("class_name")
        if target is not None and str(target) not in VERL_MCP_CLASSES:
            check_mcp_class(tool_class(str(target), f"{where} class_name"), str(target), where)
        load_server_specs(entry.get("mcp"), where, path.parent)
        import_mcp()


def _is_mcp(entry: Any) -> bool:
    return isinstance(entry, dict) and (entry.get("config") or {}).get("type") == "mcp"


def initialize_tools_from_config(tool_config_path: str | Path) -> list[BaseTool]:
    """All tools of a ``tool_config_path`` YAML, validated (a ``type: mcp`` entry gives every
    tool its servers list)."""
    path = Path(tool_config_path).expanduser()
    entries = load_yaml_entries(path, "tools", "tool_config_path")
    tools: list[BaseTool] = []
    for i, entry in enumerate(entries):
        where = f"{path} tools[{i}]"
        if _is_mcp(entry):
            built = build_mcp_tools(entry, where, path.parent)
        else:
            built = [build_tool(entry, where)]
        for tool in built:
            if any(t.name == tool.name for t in tools):
                raise ConfigError(f"{where}: duplicate tool name {tool.name!r}")
            tools.append(tool)
    return tools


def load_all_tools(
    tool_config_path: str | Path | None = None, function_tool_path: str | Path | None = None
) -> list[BaseTool]:
    """The tools of ``tool_config_path`` (YAML) followed by those of ``function_tool_path`` (Python
    file).

    Either may be None or empty.  A function tool named like a YAML tool raises ConfigError.
    """
    native = initialize_tools_from_config(tool_config_path) if tool_config_path else []
    functions: list[FunctionTool] = (
        load_function_tools_from_path(function_tool_path) if function_tool_path else []
    )
    clashes = sorted({t.name for t in native} & {t.name for t in functions})
    if clashes:
        raise ConfigError(
            f"function tool name(s) {clashes} from function_tool_path "
            f"{str(function_tool_path)!r} are also "
            f"declared in tool_config_path {str(tool_config_path)!r}; tool names must be "
            f"unique, rename one"
        )
    return [*native, *functions]
