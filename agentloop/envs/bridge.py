"""A bridge process: another interpreter spoken to over JSON lines (the protocol of
:mod:`agentloop.envs.subprocess_env`; docs/environments.md#out-of-process-environments).

:class:`BridgeProcess` starts ``python -P script`` in its own process group, connects its pipes to
the running event loop and matches each reply to its request by ``id`` (so one bridge can serve
several sessions at once). A bridge that dies, hangs up or writes a line that is not a reply fails
every request in flight with :class:`BridgeError` (exit code and stderr tail); the process group
is killed with :meth:`BridgeProcess.kill`. :func:`shared_bridge` keeps one bridge per key and event
loop (a worker's pooled bridge), replacing a dead one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import tempfile
import weakref
from pathlib import Path
from typing import IO, Any

__all__ = ["BridgeError", "BridgeProcess", "RemoteEnvError", "shared_bridge"]

LINE_LIMIT = 64 * 1024 * 1024
"""Largest reply line read from a bridge (bytes)."""
STDERR_TAIL = 800
"""How much of the bridge's stderr an error message quotes (characters)."""
EXIT_WAIT_S = 2.0
"""How long a bridge that hung up is waited for, to report its exit code."""


class BridgeError(RuntimeError):
    """The bridge process died, hung up or wrote something that is not a reply."""


class RemoteEnvError(RuntimeError):
    """The environment in the bridge raised; the message is its ``Type: text``."""


def _jsonable(value: Any) -> Any:
    """``json.dumps`` default: numpy values as plain ones, anything else as its text."""
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    return str(value)


def _killpg(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads (the bridge and what it started)."""
    with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
        os.killpg(pid, signal.SIGKILL)


class BridgeProcess:
    """One bridge process and its pipes (see the module docstring).

    Args:
        argv: the command (``[python, "-P", script]``). env: its environment variables.
    """

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.argv, self.env = argv, env
        self.proc: subprocess.Popen | None = None
        self.death: str | None = None
        """Why the bridge is unusable (None while it serves)."""
        self._stderr: IO[bytes] | None = None
        self._writer: asyncio.WriteTransport | None = None
        self._read_pipe: asyncio.BaseTransport | None = None
        self._pump: asyncio.Task | None = None
        self._pending: dict[int, tuple[str, asyncio.Future]] = {}
        self._ids = itertools.count(1)
        self._finalizer: Any = None

    async def open(self, config: dict[str, Any]) -> None:
        """Spawn the bridge (in a thread: no fork on the event loop's thread), connect its pipes
        and send ``start`` with ``config``.

        Raises:
            BridgeError, RemoteEnvError: as for :meth:`call`.
        """
        self._stderr = tempfile.TemporaryFile(prefix="agentloop-bridge-")  # noqa: SIM115 - closed in kill()
        proc = await asyncio.to_thread(self._spawn)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=LINE_LIMIT)
        self._read_pipe, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), proc.stdout)
        self._writer, _ = await loop.connect_write_pipe(asyncio.Protocol, proc.stdin)
        self._pump = loop.create_task(self._read_replies(reader))
        await self.call({"op": "start", "config": config})

    def _spawn(self) -> subprocess.Popen:
        """Start the bridge in its own session; kept on ``self`` at once, so that a caller
        cancelled while this thread runs still has :meth:`kill` reach it."""
        self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr,
                                     start_new_session=True)
        self._finalizer = weakref.finalize(self, _killpg, self.proc.pid)
        return self.proc

    @property
    def alive(self) -> bool:
        """The bridge is running and its replies are read."""
        return self.death is None and self.proc is not None and self.proc.poll() is None

    async def call(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send ``request`` (an ``id`` is added) and wait for its reply.

        Raises:
            BridgeError: the bridge is gone, hung up or wrote a line that is not a reply.
            RemoteEnvError: the reply is ``{"ok": false, "error": ...}``.
            asyncio.CancelledError: the caller was cancelled (the reply, if any, is dropped).
        """
        op = str(request["op"])
        if self.death is not None or self._writer is None or self._writer.is_closing():
            raise BridgeError(self.death or f"the bridge is not running ({op})")
        rid = next(self._ids)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending[rid] = (op, future)
        try:
            self._writer.write((json.dumps({**request, "id": rid}, default=_jsonable)
                                + "\n").encode())
            reply = await future
        finally:
            self._pending.pop(rid, None)
        if not reply.get("ok"):
            raise RemoteEnvError(str(reply.get("error") or f"{op} failed (no error given)"))
        return reply  # type: ignore[no-any-return]

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        """Hand each reply to its request; on the bridge's end, fail every request in flight."""
        while True:
            try:
                line = await reader.readline()
            except (ValueError, asyncio.LimitOverrunError) as e:
                death = f"the bridge wrote a reply over {LINE_LIMIT} bytes ({e})"
                break
            if not line:
                death = await self._hung_up()
                break
            try:
                reply = json.loads(line)
                rid = reply["id"]
            except (ValueError, TypeError, KeyError):
                death = (f"the bridge wrote a line that is not a reply: {line[:200]!r}; "
                         f"{self.tail()}")
                break
            _, future = self._pending.get(rid, ("", None))
            if future is not None and not future.done():
                future.set_result(reply)
        self.death = death
        for _, future in list(self._pending.values()):
            if not future.done():
                future.set_exception(BridgeError(death))
        self.kill()

    async def _hung_up(self) -> str:
        """The message for a bridge that closed its stdout: what it was asked, exit code, stderr
        tail."""
        code = await self.exited(EXIT_WAIT_S)
        how = "is still running" if code is None else f"exited with code {code}"
        ops = sorted({op for op, _ in self._pending.values()})
        asked = f" and did not answer {', '.join(ops)}" if ops else ""
        return f"the bridge ({Path(self.argv[-1]).name}) {how}{asked}; {self.tail()}"

    async def exited(self, wait_s: float) -> int | None:
        """The bridge's exit code, waiting up to ``wait_s`` for it; None while it runs."""
        if self.proc is None:
            return None
        delay, waited = 0.005, 0.0
        while (code := self.proc.poll()) is None and waited < wait_s:
            await asyncio.sleep(delay)
            waited += delay
            delay = min(delay * 2, 0.1)
        return code

    def tail(self) -> str:
        """The last :data:`STDERR_TAIL` characters of the bridge's stderr, on one line."""
        if self._stderr is None or self._stderr.closed:
            return "stderr: (none)"
        fd = self._stderr.fileno()
        size = os.fstat(fd).st_size
        start = max(0, size - STDERR_TAIL)
        text = os.pread(fd, size - start, start).decode(errors="replace").strip()
        return "stderr: " + (" | ".join(line for line in text.splitlines() if line) or "(empty)")

    def kill(self) -> None:
        """Kill the bridge's process group and close the pipes (idempotent; the stderr file is
        kept for :meth:`tail` until :meth:`release`)."""
        if self.death is None:
            self.death = f"the bridge ({Path(self.argv[-1]).name}) was stopped"
        if self.proc is not None:
            _killpg(self.proc.pid)
            with contextlib.suppress(OSError):
                self.proc.kill()
        if self._finalizer is not None:
            self._finalizer.detach()
        for pipe in (self._writer, self._read_pipe):
            if pipe is not None:
                pipe.close()
        if self._pump is not None and self._pump is not asyncio.current_task():
            self._pump.cancel()

    async def release(self) -> None:
        """Kill, reap the process and drop the stderr file."""
        self.kill()
        await self.exited(EXIT_WAIT_S)
        if self._stderr is not None:
            self._stderr.close()


_SHARED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Any]] = (
    weakref.WeakKeyDictionary())
"""Per event loop: key -> the shared bridge, and key -> the lock that starts it."""


async def shared_bridge(key: str, argv: list[str], env: dict[str, str],
                        config: dict[str, Any]) -> BridgeProcess:
    """The bridge shared by every caller on this event loop with the same ``key`` (started on
    first use, replaced once dead).

    Raises:
        BridgeError, RemoteEnvError: starting it failed (the next call tries again).
    """
    slots = _SHARED.setdefault(asyncio.get_running_loop(), {"bridges": {}, "locks": {}})
    lock = slots["locks"].setdefault(key, asyncio.Lock())
    async with lock:
        bridge = slots["bridges"].get(key)
        if bridge is None or not bridge.alive:
            if bridge is not None:
                await bridge.release()
            bridge = BridgeProcess(argv, env)
            slots["bridges"][key] = bridge
            try:
                await bridge.open(config)
            except BaseException:
                slots["bridges"].pop(key, None)
                await asyncio.shield(bridge.release())
                raise
        return bridge  # type: ignore[no-any-return]
