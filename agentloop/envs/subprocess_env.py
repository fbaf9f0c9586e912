"""An environment run by another Python interpreter, proxied over JSON lines
(docs/environments.md#out-of-process-environments).

Some environment packages cannot be installed next to the engine (their pins clash with vLLM's);
they run in their own virtualenv instead. :class:`SubprocessEnv` (registered ``subprocess``) is the
:class:`~agentloop.envs.base.Environment` protocol proxied to a *bridge*: a script run by that
venv's interpreter, one process per environment instance (one per sample), which imports the real
environment there. Requests go to the bridge's stdin and each is answered by one line on its
stdout, in order (plain JSON)::

    {"op": "start", "config": {...}}          -> {"ok": true}
    {"op": "reset", "sample": {...}}          -> {"ok": true, "messages": [...], "tools": null,
                                                  "info": {}}
    {"op": "step", "turn": {"text", "content", "tool_calls"}}
                                              -> {"ok": true, "messages": [...], "reward": 0.0,
                                                  "done": false, "info": {}}
    {"op": "close"}                           -> {"ok": true}   (the bridge then exits)

A failure is ``{"ok": false, "error": "ValueError: ..."}``. The bridge runs in its own process
group, which is killed on ``close()`` (also after a timeout or a cancellation), so a server it
started goes with it. A bridge that dies is the sample's error, with its exit code and stderr tail.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from agentloop.envs.base import AssistantTurn, EnvReset, EnvStep, register_env
from agentloop.errors import ConfigError

__all__ = ["BridgeError", "RemoteEnvError", "SubprocessEnv", "check_interpreter"]

LINE_LIMIT = 64 * 1024 * 1024
"""Largest reply line read from a bridge (bytes)."""
STDERR_TAIL = 800
"""How much of the bridge's stderr an error message quotes (characters)."""
_EXIT_WAIT_S = 2.0
"""How long a bridge that closed its stdout is waited for, to report its exit code."""


_FOUND: set[tuple[str, str]] = set()
"""(interpreter, module) pairs already found importable (each is probed once per process)."""


class BridgeError(RuntimeError):
    """The bridge process died, hung up or wrote something that is not a reply."""


class RemoteEnvError(RuntimeError):
    """The environment in the bridge raised; the message is its ``Type: text``."""


def check_interpreter(python: str, module: str | None, missing: str) -> None:
    """Refuse an interpreter that is not there (or lacks ``module``), in one line.

    Args:
        python: the interpreter's path. module: a top-level module it must import (None: any).
        missing: the fix, appended to the message (e.g. "create it with `make openenv-env`").
    Raises:
        ConfigError: no executable at ``python``, or ``module`` is not importable there.
    """
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ConfigError(f"no Python interpreter at {python!r}; {missing}")
    if module is None or (python, module) in _FOUND:
        return
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    if subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode:
        raise ConfigError(f"{python!r} has no {module} package; {missing}")
    _FOUND.add((python, module))


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


@register_env("subprocess")
class SubprocessEnv:
    """One episode in a bridge process run by another interpreter (see the module docstring).

    Args:
        python: the other venv's interpreter (relative paths from the working directory).
        script: the bridge script (run as ``python -P script``: its own directory is not put on
            ``sys.path``).
        config: sent to the bridge in its ``start`` request (what environment to build).
        path: directories put on the bridge's ``PYTHONPATH``.
        env_vars: extra environment variables of the bridge.
    """

    missing_fix = "set the env config's 'python' to a virtualenv's interpreter"
    """The fix named when the interpreter is missing (adapters name their make target)."""
    required_module: str | None = None
    """A module the interpreter must import (checked before any engine starts)."""

    def __init__(self, python: str, script: str, config: Mapping[str, Any] | None = None,
                 path: list[str] | None = None, env_vars: Mapping[str, str] | None = None) -> None:
        self.argv = [str(Path(python).absolute()), "-P", str(Path(script).absolute())]
        self.config = dict(config or {})
        paths = [str(Path(p).absolute()) for p in (path or [])]
        self.env = {**os.environ, **dict(env_vars or {}), "PYTHONPATH": os.pathsep.join(paths)}
        self._proc: subprocess.Popen | None = None
        self._stderr: IO[bytes] | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.WriteTransport | None = None
        self._read_pipe: asyncio.BaseTransport | None = None
        self._finalizer: Any = None

    @classmethod
    def check_config(cls, config: Mapping[str, Any]) -> None:
        """The start-up check: the interpreter and the bridge script are there.

        Raises:
            ConfigError: either is missing (one line naming the fix).
        """
        python = str(config.get("python") or "")
        check_interpreter(python, cls.required_module, cls.missing_fix)
        script = config.get("script")
        if script is not None and not os.path.isfile(str(script)):
            raise ConfigError(f"no bridge script at {str(script)!r} (the env config's 'script')")

    async def reset(self, sample: dict[str, Any]) -> EnvReset:
        """Start the bridge (first call) and reset its environment.

        Raises:
            BridgeError: the bridge died or answered nonsense. RemoteEnvError: the environment
                raised (its message).
        """
        if self._proc is None:
            await self._start()
        reply = await self._call({"op": "reset", "sample": sample})
        return EnvReset(list(reply.get("messages") or []), tools=reply.get("tools"),
                        info=dict(reply.get("info") or {}))

    async def step(self, turn: AssistantTurn) -> EnvStep:
        """Hand the assistant turn to the bridge; its observation, reward and done.

        Raises:
            BridgeError, RemoteEnvError: as for :meth:`reset`.
        """
        reply = await self._call({"op": "step", "turn": dataclasses.asdict(turn)})
        reward = reply.get("reward")
        return EnvStep(list(reply.get("messages") or []),
                       reward=0.0 if reward is None else reward,
                       done=bool(reply.get("done")), info=dict(reply.get("info") or {}))

    async def close(self) -> None:
        """Ask the bridge to close its environment, then kill its process group (always).

        Raises:
            RemoteEnvError: the environment's close raised (the bridge is killed anyway).
        """
        if self._proc is None:
            return
        try:
            if self._proc.poll() is None and self._reader is not None:
                with contextlib.suppress(BridgeError):
                    await self._call({"op": "close"})
                await self._exited(_EXIT_WAIT_S)
        finally:
            self._kill()
            await self._exited(_EXIT_WAIT_S)  # reap it
            if self._stderr is not None:
                self._stderr.close()
                self._stderr = None

    async def _start(self) -> None:
        """Spawn the bridge (in a thread: no fork on the event loop's thread), connect its pipes
        to the loop, and send ``start``."""
        self._stderr = tempfile.TemporaryFile(prefix="agentloop-bridge-")  # noqa: SIM115 - closed in close()
        proc = await asyncio.to_thread(self._spawn)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=LINE_LIMIT)
        self._read_pipe, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), proc.stdout)
        writer, _ = await loop.connect_write_pipe(asyncio.Protocol, proc.stdin)
        self._reader, self._writer = reader, writer
        await self._call({"op": "start", "config": self.config})

    def _spawn(self) -> subprocess.Popen:
        """Start the bridge in its own session; kept on ``self`` at once, so that a caller
        cancelled while this thread runs still has ``close()`` kill it."""
        proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=self._stderr,
                                start_new_session=True)
        self._proc = proc
        self._finalizer = weakref.finalize(self, _killpg, proc.pid)
        return proc

    async def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send one request and read its reply; a cancellation (a timeout) kills the bridge.

        Raises:
            BridgeError: the bridge is gone, hung up or wrote a line that is not a reply.
            RemoteEnvError: the reply is ``{"ok": false, ...}``.
        """
        op = request["op"]
        if self._reader is None or self._writer is None or self._writer.is_closing():
            raise BridgeError(await self._died(op))
        try:
            self._writer.write((json.dumps(request, default=_jsonable) + "\n").encode())
            line = await self._reader.readline()
        except asyncio.CancelledError:
            self._kill()
            raise
        except (ValueError, asyncio.LimitOverrunError) as e:
            self._kill()
            raise BridgeError(f"the bridge's {op} reply is over {LINE_LIMIT} bytes ({e})") from e
        if not line:
            raise BridgeError(await self._died(op))
        try:
            reply = json.loads(line)
        except ValueError:
            raise BridgeError(f"the bridge answered {op} with a line that is not JSON: "
                              f"{line[:200]!r}; {self._tail()}") from None
        if not isinstance(reply, dict):
            raise BridgeError(f"the bridge answered {op} with {reply!r:.200}, not an object")
        if not reply.get("ok"):
            raise RemoteEnvError(str(reply.get("error") or f"{op} failed (no error given)"))
        return reply

    async def _died(self, op: str) -> str:
        """The message for a bridge that hung up during ``op``: exit code and stderr tail."""
        code = await self._exited(_EXIT_WAIT_S)
        how = "is still running" if code is None else f"exited with code {code}"
        script = Path(self.argv[-1]).name
        return f"the bridge ({script}) {how} and did not answer {op}; {self._tail()}"

    async def _exited(self, wait_s: float) -> int | None:
        """The bridge's exit code, waiting up to ``wait_s`` for it; None while it runs."""
        proc = self._proc
        if proc is None:
            return None
        delay, waited = 0.005, 0.0
        while (code := proc.poll()) is None and waited < wait_s:
            await asyncio.sleep(delay)
            waited += delay
            delay = min(delay * 2, 0.1)
        return code

    def _tail(self) -> str:
        """The last :data:`STDERR_TAIL` characters of the bridge's stderr, on one line."""
        if self._stderr is None:
            return "stderr: (none)"
        fd = self._stderr.fileno()
        size = os.fstat(fd).st_size
        start = max(0, size - STDERR_TAIL)
        text = os.pread(fd, size - start, start).decode(errors="replace").strip()
        return "stderr: " + (" | ".join(line for line in text.splitlines() if line) or "(empty)")

    def _kill(self) -> None:
        """Kill the bridge's process group and close the pipes (idempotent)."""
        if self._proc is not None:
            _killpg(self._proc.pid)
            with contextlib.suppress(OSError):
                self._proc.kill()
        if self._finalizer is not None:
            self._finalizer.detach()
        for pipe in (self._writer, self._read_pipe):
            if pipe is not None:
                pipe.close()
