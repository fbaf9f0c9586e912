"""One MCP server seen from one process: its client sessions, started lazily and restarted.

An :class:`MCPServer` is built from a :class:`MCPServerSpec` (a stdio ``command`` or a
streamable-HTTP ``url``). Each asyncio event loop that calls it gets one
:class:`MCPConnection` (one server process or HTTP session), started on the first call and shared
by every sample of that loop (a rollout worker runs its samples on one loop). A call that fails
with a transport error, or that times out on a server that then does not answer a ping, marks the
connection broken; the next call closes it and starts a fresh one (a new server process for stdio).

The ``mcp`` SDK is an optional dependency (``pip install agentloop[mcp]``): it is imported when a
connection starts, not when this module is imported.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import Callable, Coroutine
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, TypeVar

from agentloop.errors import ConfigError

logger = logging.getLogger(__name__)
T = TypeVar("T")

INSTALL_HINT = (
    "MCP tools need the mcp SDK: pip install 'agentloop[mcp]' (or pip install 'mcp>=1.19')"
)


class MCPServerError(RuntimeError):
    """An MCP server could not be reached, crashed or hung during a call (the model sees the
    message; the connection is restarted on the next call)."""


@dataclass(frozen=True)
class MCPServerSpec:
    """How to reach one MCP server (one entry of the ``mcpServers`` mapping).

    Attributes:
        name: the server's key in the mapping.
        command, args, env, cwd: stdio transport: the process to start.
        url, headers: streamable-HTTP transport (verl's ``auth_token`` becomes a Bearer header).
        start_timeout: seconds allowed for starting the server and the MCP handshake.
    """

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    start_timeout: float = 30.0

    @property
    def transport(self) -> str:
        """``stdio`` or ``streamable_http``."""
        return "stdio" if self.command else "streamable_http"


def import_mcp() -> Any:
    """The ``mcp`` package; ConfigError naming the extra to install when it is missing."""
    try:
        import mcp  # optional dependency (the mcp extra)
    except ImportError as e:
        raise ConfigError(f"{INSTALL_HINT} ({e})") from e
    return mcp


async def _open_streams(spec: MCPServerSpec, stack: AsyncExitStack) -> tuple[Any, Any]:
    """Enter the transport of ``spec`` on ``stack``; returns (read stream, write stream)."""
    mcp = import_mcp()
    if spec.command:
        params = mcp.StdioServerParameters(
            command=spec.command, args=list(spec.args), env=dict(spec.env) or None, cwd=spec.cwd
        )
        streams = await stack.enter_async_context(mcp.stdio_client(params, errlog=sys.stderr))
        return streams[0], streams[1]
    # optional dependency (the mcp extra), imported with the transport it serves
    from mcp.client import streamable_http
    from mcp.shared._httpx_utils import create_mcp_http_client

    if hasattr(streamable_http, "streamable_http_client"):  # mcp >= 1.24 (and 2.x)
        client = await stack.enter_async_context(
            create_mcp_http_client(headers=dict(spec.headers) or None)
        )
        cm = streamable_http.streamable_http_client(str(spec.url), http_client=client)
    else:  # mcp 1.19 - 1.23
        legacy: Any = streamable_http
        cm = legacy.streamablehttp_client(str(spec.url), headers=dict(spec.headers) or None)
    streams = await stack.enter_async_context(cm)
    return streams[0], streams[1]


def dumped(model: Any) -> dict[str, Any]:
    """An SDK result as a dict with the protocol's (camelCase) names, for mcp 1.x and 2.x alike."""
    return model.model_dump(by_alias=True, exclude_none=True)


class MCPConnection:
    """One started server and its client session, owned by a background task of one event loop
    (the SDK's transports must be entered and left in the same task)."""

    def __init__(self, spec: MCPServerSpec) -> None:
        self.spec = spec
        self.session: Any = None
        self.broken = False
        self._stop = asyncio.Event()
        self._ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._own(), name=f"mcp-{spec.name}")

    async def _own(self) -> None:
        try:
            async with AsyncExitStack() as stack:
                mcp = import_mcp()
                read, write = await _open_streams(self.spec, stack)
                session = await stack.enter_async_context(mcp.ClientSession(read, write))
                await session.initialize()
                self.session = session
                self._ready.set_result(None)
                await self._stop.wait()
        except BaseException as e:  # noqa: BLE001 - reported to the caller, or the task ends
            self.broken = True
            if not self._ready.done():
                self._ready.set_exception(e if isinstance(e, Exception) else MCPServerError(str(e)))
                self._ready.exception()  # retrieved: ready() re-raises it, or nobody waits
            if not isinstance(e, Exception):
                raise
            logger.warning("MCP server %r: connection ended: %s", self.spec.name, e)
        finally:
            self.broken = True

    async def ready(self) -> Any:
        """Wait for the handshake (``spec.start_timeout``); returns the client session.

        Raises:
            MCPServerError: the server did not start or did not complete the handshake in time.
        """
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), self.spec.start_timeout)
        except asyncio.TimeoutError as e:
            self.broken = True
            raise MCPServerError(
                f"MCP server {self.spec.name!r} did not start within {self.spec.start_timeout:g}s"
            ) from e
        except ConfigError:
            raise
        except Exception as e:
            raise MCPServerError(
                f"MCP server {self.spec.name!r} could not be started: {type(e).__name__}: {e}"
            ) from e
        return self.session

    @property
    def alive(self) -> bool:
        """False once the connection failed or its owner task ended."""
        return not self.broken and not self._task.done()

    async def close(self) -> None:
        """Stop the server (stdio: the SDK terminates the process) and wait for the task; never
        raises."""
        self._stop.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), 5.0)
        except BaseException:  # noqa: BLE001 - a hung shutdown: cancel the owner task
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def answers_ping(self, timeout: float) -> bool:
        """Whether the server answers a ping within ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self.session.send_ping(), timeout)
        except Exception:  # noqa: BLE001 - any failure means "no"
            return False
        return True


class MCPServer:
    """A server shared by the tools listed from it; one :class:`MCPConnection` per event loop.

    Attributes:
        spec: how to reach the server.
        starts: connections started so far in this process (the listing at load time included).
        restarts: connections that replaced a crashed or hung one.
        failures: calls that failed because the server crashed, hung or could not be reached.
    """

    def __init__(self, spec: MCPServerSpec) -> None:
        self.spec = spec
        self.starts = 0
        self.restarts = 0
        self.failures = 0
        self._connections: dict[asyncio.AbstractEventLoop, MCPConnection] = {}
        self._suspect: set[MCPConnection] = set()
        self._closing: set[asyncio.Task[None]] = set()

    async def connection(self, budget: float | None = None) -> MCPConnection:
        """This event loop's live connection, started (or restarted) when needed.

        Args:
            budget: the caller's time limit in seconds (None: none); a connection whose last call
                timed out must answer a ping within a quarter of it (at most 5 s), else it is
                taken for hung and restarted.
        """
        loop = asyncio.get_running_loop()
        conn = self._connections.get(loop)
        if conn is not None and conn in self._suspect:
            await self._check(conn, min(5.0, budget / 4) if budget else 5.0)
        if conn is None or not conn.alive:
            if conn is not None:  # stopped in the background: a hung process may take seconds
                closing = asyncio.create_task(conn.close())
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)
                self.restarts += 1
                logger.warning("MCP server %r: restarting (restart %d)", self.spec.name,
                               self.restarts)
            self.starts += 1
            conn = self._connections[loop] = MCPConnection(self.spec)
        await conn.ready()
        return conn

    async def _check(self, conn: MCPConnection, timeout: float) -> None:
        """Ping a connection whose call timed out; one that does not answer (or whose check is
        cut short) is marked broken."""
        try:
            ok = conn.alive and await conn.answers_ping(timeout)
        except asyncio.CancelledError:
            ok = False
            raise
        finally:
            self._suspect.discard(conn)
            if not ok:
                conn.broken = True

    async def list_tools(self) -> list[dict[str, Any]]:
        """Every tool the server offers, as the protocol's dicts (``name``, ``description``,
        ``inputSchema``)."""
        session = (await self.connection()).session
        tools: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            if cursor is None:
                page = dumped(await session.list_tools())
            else:
                params = import_mcp().types.PaginatedRequestParams(cursor=cursor)
                page = dumped(await session.list_tools(params=params))
            tools.extend(page.get("tools") or [])
            cursor = page.get("nextCursor")
            if not cursor:
                return tools

    async def call_tool(
        self, name: str, arguments: dict[str, Any], timeout: float | None
    ) -> dict[str, Any]:
        """Call tool ``name``; returns the result as the protocol's dict (``content``,
        ``isError``).

        Raises:
            MCPServerError: the server could not be started or the transport failed (the
                connection is restarted on the next call).
            asyncio.TimeoutError: no answer within ``timeout`` seconds (a server that then misses
                a ping is restarted on the next call).
        """
        try:
            conn = await self.connection(timeout)
        except MCPServerError:
            self.failures += 1
            raise
        try:
            call = conn.session.call_tool(name, arguments)
            return dumped(await (asyncio.wait_for(call, timeout) if timeout else call))
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self._suspect.add(conn)
            raise
        except Exception as e:
            self.failures += 1
            conn.broken = True
            raise MCPServerError(
                f"MCP server {self.spec.name!r} failed during the call: {type(e).__name__}: {e}"
            ) from e

    async def aclose(self) -> None:
        """Close this event loop's connection (if any)."""
        conn = self._connections.pop(asyncio.get_running_loop(), None)
        if conn is not None:
            await conn.close()


def run_in_fresh_loop(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``factory()`` to completion on a new event loop in a new thread (safe to call from
    inside a running loop); re-raises its exception."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(factory())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, name="mcp-list-tools", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
