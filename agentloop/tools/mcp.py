"""MCP tool servers as tools: every tool an MCP server lists becomes a :class:`MCPTool`.

A tool YAML entry with ``config.type: mcp`` (verl's spelling) stands for all the tools of one or
more MCP servers::

    tools:
      - class_name: verl.tools.mcp_search_tool.MCPSearchTool   # optional; verl's MCP classes and
        config: {type: mcp, timeout: 30}                        # MCPTool subclasses are accepted
        mcp:
          mcp_servers_config_path: mcp_servers.json   # {"mcpServers": {name: {...}}} (JSON or YAML)
          mcp_servers: {name: {...}}                  # or inline, same shape
          servers: [name]                             # optional: only these servers
          tool_selected_list: [tool, ...]             # optional (verl): only these tools

A server is ``{command, args, env, cwd}`` (stdio: the process is started by the SDK; ``command:
python`` / ``python3`` means the interpreter running agentloop) or
``{url, headers, auth_token}`` (streamable HTTP), plus an optional ``start_timeout`` (seconds).
The tools are listed once when the YAML is loaded (a short-lived connection, so a server that
does not start is a ConfigError before any engine starts); their ``inputSchema`` is the OpenAI
function's ``parameters``. Calls go through :class:`~agentloop.tools.mcp_client.MCPServer`: one
session per server per worker event loop, started on the first call; ``config.timeout`` bounds
each call; a crashed or hung server becomes an error message to the model (counted in
``num_tool_errors`` / ``num_tool_timeouts``) and is restarted on the next call.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from pydantic import ValidationError

from agentloop.errors import ConfigError
from agentloop.tools.base import BaseTool
from agentloop.tools.mcp_client import (
    MCPServer,
    MCPServerError,
    MCPServerSpec,
    import_mcp,
    run_in_fresh_loop,
)
from agentloop.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = [
    "MCPServer", "MCPServerError", "MCPServerSpec", "MCPTool", "MCPToolError", "import_mcp",
    "load_mcp_tools", "load_server_specs",
]

DEFAULT_TIMEOUT = 30.0
"""Seconds one MCP call may take when the entry's ``config.timeout`` is not given."""
VERL_MCP_CLASSES = frozenset({
    "verl.tools.mcp_base_tool.MCPBaseTool", "verl.tools.mcp_search_tool.MCPSearchTool",
})
"""verl's MCP tool classes: a ``class_name`` naming one loads :class:`MCPTool`."""
PYTHON_COMMANDS = frozenset({"python", "python3"})
"""A server ``command`` spelled so runs the interpreter that runs agentloop (its packages)."""
_MCP_KEYS = {"mcp_servers_config_path", "mcp_servers", "servers", "tool_selected_list"}
_SERVER_KEYS = {
    "command", "args", "env", "cwd", "url", "headers", "auth_token", "start_timeout", "type",
    "transport", "description", "disabled",
}


class MCPToolError(RuntimeError):
    """The MCP tool answered with ``isError: true`` (its text is the message)."""


class MCPTool(BaseTool):
    """One tool of an MCP server.

    Args:
        config: the YAML entry's ``config`` (``timeout``: seconds per call, default 30).
        tool_schema: the OpenAI function schema built from the server's tool listing.
        server: the server the tool belongs to (shared by its tools).
    """

    def __init__(
        self, config: Mapping[str, Any] | None, tool_schema: OpenAIFunctionToolSchema,
        server: MCPServer,
    ) -> None:
        super().__init__({"timeout": DEFAULT_TIMEOUT, **dict(config or {})}, tool_schema)
        self.server = server

    async def create(
        self, instance_id: str | None = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        """Make sure this worker's session to the server is up (started, or restarted after a
        crash or a hang) before the call, so the call's own time limit is the call's.

        Raises:
            MCPServerError: the server could not be started.
        """
        await self.server.connection(self.config.get("timeout") or None)
        return await super().create(instance_id, **kwargs)

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        """Call the tool on its server; returns (the result's text, 0.0, {}).

        Raises:
            MCPToolError: the tool reported an error (``isError``).
            MCPServerError: the server crashed or could not be started.
            asyncio.TimeoutError: no answer within ``config.timeout`` seconds.
        """
        timeout = self.config.get("timeout") or None
        result = await self.server.call_tool(self.name, dict(parameters or {}), timeout)
        text = self.result_text(result)
        if result.get("isError"):
            raise MCPToolError(text)
        return ToolResponse(text=text), 0.0, {}

    @staticmethod
    def result_text(result: Mapping[str, Any]) -> str:
        """The text of a call result: its text contents joined by newlines (other contents as a
        ``[type content]`` note; ``structuredContent`` as JSON when there is no content)."""
        parts = []
        for block in result.get("content") or []:
            if block.get("type") == "text":
                parts.append(str(block.get("text", "")))
            else:
                parts.append(f"[{block.get('type')} content]")
        if not parts and result.get("structuredContent") is not None:
            parts.append(json.dumps(result["structuredContent"]))
        return "\n".join(parts)


def _server_spec(name: str, raw: Any, where: str) -> MCPServerSpec:
    """One server entry, checked."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: MCP server {name!r} must be a mapping, got {raw!r}")
    unknown = sorted(set(raw) - _SERVER_KEYS)
    if unknown:
        raise ConfigError(f"{where}: MCP server {name!r} has unknown key(s) {unknown}; known: "
                          f"{sorted(_SERVER_KEYS)}")
    command, url = raw.get("command"), raw.get("url")
    if bool(command) == bool(url):
        raise ConfigError(
            f"{where}: MCP server {name!r} needs either 'command' (a stdio server, with 'args' "
            f"and 'env') or 'url' (a streamable-HTTP server), got {dict(raw)!r}"
        )
    headers = {str(k): str(v) for k, v in (raw.get("headers") or {}).items()}
    if raw.get("auth_token"):
        headers.setdefault("Authorization", f"Bearer {raw['auth_token']}")
    try:
        start_timeout = float(raw.get("start_timeout") or 30.0)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: MCP server {name!r}: 'start_timeout' must be a number of "
                          f"seconds, got {raw.get('start_timeout')!r}") from e
    args = raw.get("args") or []
    if not isinstance(args, list | tuple):
        raise ConfigError(f"{where}: MCP server {name!r}: 'args' must be a list, got {args!r}")
    if command in PYTHON_COMMANDS:
        command = sys.executable
    return MCPServerSpec(
        name=name, command=str(command) if command else None, args=tuple(str(a) for a in args),
        env={str(k): str(v) for k, v in (raw.get("env") or {}).items()},
        cwd=str(raw["cwd"]) if raw.get("cwd") else None, url=str(url) if url else None,
        headers=headers, start_timeout=start_timeout,
    )


def _servers_file(path: Path, where: str) -> dict[str, Any]:
    """The ``mcpServers`` mapping of an MCP servers config file (JSON or YAML)."""
    if not path.is_file():
        raise ConfigError(f"{where}: mcp.mcp_servers_config_path {str(path)!r} does not exist")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as e:  # noqa: BLE001 - a parse error of any kind is a config error
        raise ConfigError(f"{where}: cannot read MCP servers config {str(path)!r}: {e}") from e
    servers = data.get("mcpServers") if isinstance(data, dict) else None
    if not isinstance(servers, dict):
        raise ConfigError(f"{where}: {str(path)!r} needs a top-level 'mcpServers' mapping")
    return servers


def load_server_specs(mcp_block: Any, where: str, base_dir: Path) -> list[MCPServerSpec]:
    """The servers of a tool entry's ``mcp:`` block, checked (no connection is made).

    Args:
        mcp_block: the entry's ``mcp`` mapping.
        where: the entry, for messages.
        base_dir: the directory a relative ``mcp_servers_config_path`` is resolved against when it
            does not exist relative to the working directory.

    Raises:
        ConfigError: unknown keys, no servers, an unknown server name, a server without
            ``command`` or ``url``.
    """
    if not isinstance(mcp_block, Mapping):
        raise ConfigError(f"{where}: config.type mcp needs an 'mcp:' mapping with "
                          f"mcp_servers_config_path (or mcp_servers)")
    unknown = sorted(set(mcp_block) - _MCP_KEYS)
    if unknown:
        raise ConfigError(f"{where}: mcp has unknown key(s) {unknown}; known: {sorted(_MCP_KEYS)}")
    raw: dict[str, Any] = {}
    if mcp_block.get("mcp_servers_config_path"):
        path = Path(str(mcp_block["mcp_servers_config_path"])).expanduser()
        if not path.is_absolute() and not path.exists():
            path = base_dir / path
        raw.update(_servers_file(path, where))
    raw.update(dict(mcp_block.get("mcp_servers") or {}))
    if not raw:
        raise ConfigError(f"{where}: no MCP servers: give mcp.mcp_servers_config_path (a file with "
                          f"an 'mcpServers' mapping) or mcp.mcp_servers")
    chosen = mcp_block.get("servers")
    if chosen:
        names = [str(n) for n in chosen]
    else:
        names = [n for n in raw if not (isinstance(raw[n], Mapping) and raw[n].get("disabled"))]
    missing = [n for n in names if n not in raw]
    if missing:
        raise ConfigError(f"{where}: unknown MCP server(s) {missing} in mcp.servers; the config "
                          f"has {sorted(raw)}")
    return [_server_spec(n, raw[n], where) for n in names]


def check_mcp_class(cls: type[BaseTool], target: str, where: str) -> type[MCPTool]:
    """``cls`` (resolved from the entry's ``class_name``) when it is an MCPTool subclass.

    Raises:
        ConfigError: any other class.
    """
    if not issubclass(cls, MCPTool):
        raise ConfigError(f"{where}: config.type mcp needs class_name to be an MCPTool subclass "
                          f"(agentloop.tools.mcp.MCPTool) or verl's MCP tool class, got {target!r}")
    return cls


async def _list_all(servers: list[MCPServer]) -> list[tuple[MCPServer, list[dict[str, Any]]]]:
    """Each server's tools, from a short-lived connection closed before returning."""
    listed = []
    try:
        for server in servers:
            listed.append((server, await server.list_tools()))
    finally:
        for server in servers:
            await server.aclose()
    return listed


def load_mcp_tools(
    entry: Mapping[str, Any], where: str, cls: type[MCPTool] = MCPTool,
    base_dir: Path | None = None,
) -> list[MCPTool]:
    """The tools of one ``config.type: mcp`` YAML entry: the servers are started once to list
    their tools, then stopped (the workers' sessions start on the first call).

    Args:
        entry: the YAML entry (``config``, ``mcp``).
        where: the entry, for messages.
        cls: the class of the tools (:class:`MCPTool` or a subclass).
        base_dir: where a relative servers file is looked for besides the working directory.

    Raises:
        ConfigError: a bad ``mcp:`` block, the mcp SDK missing, a server that does not start or
            list its tools, a ``tool_selected_list`` name no server offers, a duplicate name.
    """
    specs = load_server_specs(entry.get("mcp"), where, base_dir or Path.cwd())
    import_mcp()
    servers = [MCPServer(spec) for spec in specs]
    try:
        listed = run_in_fresh_loop(lambda: _list_all(servers))
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{where}: listing the MCP servers' tools failed: {e}") from e
    selected = entry["mcp"].get("tool_selected_list")
    config = dict(entry.get("config") or {})
    tools: list[MCPTool] = []
    for server, listing in listed:
        for raw in listing:
            if selected and raw["name"] not in selected:
                continue
            tools.append(cls(config, _schema(raw, server.spec.name, where), server))
    offered = {t.name for t in tools}
    absent = [n for n in (selected or []) if n not in offered]
    if absent:
        raise ConfigError(f"{where}: mcp.tool_selected_list names {absent}, which no server "
                          f"offers; offered: {sorted(offered)}")
    return tools


def _schema(raw: Mapping[str, Any], server: str, where: str) -> OpenAIFunctionToolSchema:
    """The OpenAI function schema of one listed MCP tool."""
    schema = dict(raw.get("inputSchema") or {})
    parameters = {
        "type": "object", "required": list(schema.get("required") or []),
        "properties": {k: _property(v) for k, v in (schema.get("properties") or {}).items()},
    }
    function = {"name": raw["name"], "description": raw.get("description") or "",
                "parameters": parameters}
    try:
        return OpenAIFunctionToolSchema.model_validate({"type": "function", "function": function})
    except ValidationError as e:
        raise ConfigError(f"{where}: MCP server {server!r} tool {raw['name']!r}: its inputSchema "
                          f"is not an OpenAI function schema: {e}") from e


def _property(prop: Mapping[str, Any]) -> dict[str, Any]:
    """One parameter's schema in the OpenAI subset: ``type`` (from ``anyOf`` / ``oneOf`` when the
    property has none; ``string`` when nothing says), ``description``, ``enum``, ``items``."""
    kind: Any = prop.get("type")
    if kind is None:
        options = [o.get("type") for o in prop.get("anyOf") or prop.get("oneOf") or []]
        kinds = [k for k in options if isinstance(k, str) and k != "null"]
        if len(kinds) == 1:
            kind = kinds[0]
        elif kinds:
            kind = kinds
        else:
            kind = "string"
    out: dict[str, Any] = {"type": kind}
    for key in ("description", "enum", "items"):
        if prop.get(key) is not None:
            out[key] = prop[key]
    return out
