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

A failure is ``{"ok": false, "error": "ValueError: ..."}``. Each request carries an ``id`` the
reply repeats. The bridge runs in its own process group, which is killed on ``close()`` (also after
a timeout or a cancellation), so a server it started goes with it. A bridge that dies is the
sample's error, with its exit code and stderr tail. With ``pool: true`` one bridge per worker (per
config) serves every sample: requests then also carry a ``session`` (one per sample), ``close``
ends only that session, and a timed-out session is closed without killing the bridge.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from uuid import uuid4

from agentloop.envs.base import AssistantTurn, EnvReset, EnvStep, register_env
from agentloop.envs.bridge import BridgeError, BridgeProcess, RemoteEnvError, shared_bridge
from agentloop.errors import ConfigError

__all__ = ["BridgeError", "RemoteEnvError", "SubprocessEnv", "check_interpreter"]

_FOUND: set[tuple[str, str]] = set()
"""(interpreter, module) pairs already found importable (each is probed once per process)."""


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
        pool: one bridge per worker and config for every sample (sessions), instead of one per
            sample.
    """

    missing_fix = "set the env config's 'python' to a virtualenv's interpreter"
    """The fix named when the interpreter is missing (adapters name their make target)."""
    required_module: str | None = None
    """A module the interpreter must import (checked before any engine starts)."""

    def __init__(self, python: str, script: str, config: Mapping[str, Any] | None = None,
                 path: list[str] | None = None, env_vars: Mapping[str, str] | None = None,
                 pool: bool = False) -> None:
        self.argv = [str(Path(python).absolute()), "-P", str(Path(script).absolute())]
        self.config = dict(config or {})
        paths = [str(Path(p).absolute()) for p in (path or [])]
        self.env = {**os.environ, **dict(env_vars or {}), "PYTHONPATH": os.pathsep.join(paths)}
        self.pool = pool
        self.session = uuid4().hex if pool else None
        self._bridge: BridgeProcess | None = None

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
        """Start the bridge (or take the worker's pooled one) and reset its environment.

        Raises:
            BridgeError: the bridge died or answered nonsense. RemoteEnvError: the environment
                raised (its message).
        """
        if self.pool:
            key = json.dumps([self.argv, self.env.get("PYTHONPATH"), self.config],
                             sort_keys=True, default=str)
            self._bridge = await shared_bridge(key, self.argv, self.env, self.config)
        elif self._bridge is None:
            self._bridge = BridgeProcess(self.argv, self.env)
            await self._call("start", self._bridge.open(self.config))
        reply = await self._request({"op": "reset", "sample": sample})
        return EnvReset(list(reply.get("messages") or []), tools=reply.get("tools"),
                        info=dict(reply.get("info") or {}))

    async def step(self, turn: AssistantTurn) -> EnvStep:
        """Hand the assistant turn to the bridge; its observation, reward and done.

        Raises:
            BridgeError, RemoteEnvError: as for :meth:`reset`.
        """
        reply = await self._request({"op": "step", "turn": dataclasses.asdict(turn)})
        reward = reply.get("reward")
        return EnvStep(list(reply.get("messages") or []),
                       reward=0.0 if reward is None else reward,
                       done=bool(reply.get("done")), info=dict(reply.get("info") or {}))

    async def close(self) -> None:
        """Close the environment: the session of a pooled bridge; else ask the bridge to close,
        then kill its process group (always).

        Raises:
            RemoteEnvError: the environment's close raised (a private bridge is killed anyway).
        """
        bridge = self._bridge
        if bridge is None:
            return
        if self.pool:
            if bridge.alive:
                await self._request({"op": "close"})
            return
        try:
            if bridge.alive:
                with contextlib.suppress(BridgeError):
                    await bridge.call({"op": "close"})
                await bridge.exited(2.0)
        finally:
            await bridge.release()

    async def _request(self, request: dict[str, Any]) -> dict[str, Any]:
        if self._bridge is None:
            raise BridgeError(f"the bridge was never started ({request['op']} before reset)")
        if self.session is not None:
            request["session"] = self.session
        return await self._call(request["op"], self._bridge.call(request))

    async def _call(self, op: str, call: Any) -> Any:
        """Await ``call``; a cancellation (a timeout) kills a private bridge, or closes this
        session of a pooled one in the background."""
        try:
            return await call
        except asyncio.CancelledError:
            bridge = self._bridge
            if bridge is not None and not self.pool:
                bridge.kill()
            elif bridge is not None and bridge.alive and op != "close":
                task = asyncio.ensure_future(bridge.call({"op": "close",
                                                          "session": self.session}))
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
            raise
