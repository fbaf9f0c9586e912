"""The OpenEnv bridge: run by the OpenEnv venv's interpreter (``.venv-openenv/bin/python -P
openenv_bridge.py``), never imported by agentloop (docs/environments.md#openenv).

It imports only the standard library and ``openenv``. It speaks the JSON-lines protocol of
:mod:`agentloop.envs.subprocess_env` on stdin/stdout (anything else printed goes to stderr): on
``start`` it starts the OpenEnv server (``python -m uvicorn <app>`` or a given command, a local
process on a free port, no Docker) or takes a URL, and connects OpenEnv's own client
(``GenericEnvClient``, or the class named by ``client``), one client per session (a pooled bridge
serves several samples at once, each request in a thread); ``reset`` calls
``client.reset(**kwargs)`` and turns the observation into a user message; ``step`` builds the
action from the assistant text (``{action_field: text}``, or an ``action_class`` instance) and
calls ``client.step(action)``; ``close`` closes the session's client (without a session: every
client, and stops the server). Replies repeat the request's ``id``.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_HIDDEN = ("metadata", "reward", "done")
"""Observation fields that are not shown to the policy (reward and done are the step's own)."""


def _import(path: str) -> Any:
    """``pkg.module.Name`` or ``pkg.module:Name``."""
    module, _, name = path.replace(":", ".").rpartition(".")
    return getattr(importlib.import_module(module), name)


def _die_with_parent() -> None:
    """In the server's child process (Linux): SIGTERM when the bridge dies, so a server is
    never left behind whatever ends the bridge."""
    try:
        import ctypes  # stdlib; only where prctl exists (optional: other systems skip it)

        ctypes.CDLL(None).prctl(1, 15)  # PR_SET_PDEATHSIG, SIGTERM
    except (OSError, AttributeError):
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_dict(value: Any) -> dict[str, Any]:
    """An observation (a dict, or a pydantic model of a typed client) as a dict."""
    if hasattr(value, "model_dump"):
        value = value.model_dump()
    return dict(value or {})


def _scalars(info: Any) -> dict[str, Any]:
    return {str(k): v for k, v in (info or {}).items() if isinstance(v, (str, int, float, bool))}


class Bridge:
    """The OpenEnv server (unless given a URL), one client per session, the config."""

    def __init__(self) -> None:
        self.config: dict[str, Any] = {}
        self.server: subprocess.Popen | None = None
        self.server_log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the bridge
        self.url = ""
        self.sessions: dict[str, Any] = {}

    def start(self, request: dict[str, Any]) -> dict[str, Any]:
        """Start the server (or take ``base_url``) and import the client class."""
        self.config = dict(request.get("config") or {})
        self.url = self.config.get("base_url") or self._serve()
        _import(self.config.get("client") or "openenv.core.generic_client.GenericEnvClient")
        return {}

    def _client(self, request: dict[str, Any], new: bool = False) -> Any:
        """The request's session's client (connected; made by ``reset``)."""
        session = str(request.get("session") or "")
        if new and session not in self.sessions:
            client_cls = _import(self.config.get("client")
                                 or "openenv.core.generic_client.GenericEnvClient")
            timeout = float(self.config.get("message_timeout") or 60.0)
            client = client_cls(base_url=self.url, message_timeout_s=timeout).sync()
            client.connect()
            self.sessions[session] = client
        if session not in self.sessions:
            raise KeyError(f"no session {session!r} (step before reset)")
        return self.sessions[session]

    def _serve(self) -> str:
        """Start the server on a free local port; its URL once ``/health`` answers."""
        port = _free_port()
        command = self.config.get("command")
        if command:
            argv = [str(a).replace("{port}", str(port)) for a in command]
        else:
            argv = [sys.executable, "-m", "uvicorn", str(self.config["app"]), "--host",
                    "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        self.server = subprocess.Popen(argv, stdout=self.server_log, stderr=self.server_log,
                                       stdin=subprocess.DEVNULL, cwd=self.config.get("cwd"),
                                       preexec_fn=_die_with_parent)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + float(self.config.get("start_timeout") or 60.0)
        while time.monotonic() < deadline:
            code = self.server.poll()
            if code is not None:
                raise RuntimeError(f"the OpenEnv server `{' '.join(argv)}` exited with code "
                                   f"{code} before it answered /health; its output: "
                                   f"{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    return url
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"the OpenEnv server `{' '.join(argv)}` did not answer /health within "
                           f"{self.config.get('start_timeout') or 60.0}s")

    def _log_tail(self) -> str:
        """The last 600 characters of the server's output, on one line."""
        self.server_log.seek(0, os.SEEK_END)
        self.server_log.seek(max(0, self.server_log.tell() - 600))
        text = self.server_log.read().decode(errors="replace")
        return " | ".join(line for line in text.splitlines() if line.strip())

    def reset(self, request: dict[str, Any]) -> dict[str, Any]:
        """``client.reset(**kwargs)``: the config's ``reset_kwargs`` under the sample's
        ``extra_info.openenv``; the observation as the prompt."""
        sample = request.get("sample") or {}
        extra = sample.get("extra_info")
        if not isinstance(extra, dict):
            extra = {}
        kwargs = {**(self.config.get("reset_kwargs") or {}), **(extra.get("openenv") or {})}
        result = self._client(request, new=True).reset(**kwargs)
        messages = []
        if self.config.get("system"):
            messages.append({"role": "system", "content": str(self.config["system"])})
        messages.append({"role": "user", "content": self._text(result.observation)})
        return {"messages": messages, "info": _scalars(self._metadata(result))}

    def step(self, request: dict[str, Any]) -> dict[str, Any]:
        """``client.step(action)`` with the assistant text in the action field."""
        turn = request.get("turn") or {}
        text = str(turn.get(self.config.get("action_text") or "text") or "")
        fields = {**(self.config.get("action_fields") or {}),
                  str(self.config.get("action_field") or "message"): text}
        action_class = self.config.get("action_class")
        action = _import(action_class)(**fields) if action_class else fields
        result = self._client(request).step(action)
        role = str(self.config.get("role") or "user")
        return {"messages": [{"role": role, "content": self._text(result.observation)}],
                "reward": 0.0 if result.reward is None else float(result.reward),
                "done": bool(result.done), "info": _scalars(self._metadata(result))}

    def _text(self, observation: Any) -> str:
        """The observation field ``observation_field``; else its only text field; else its
        fields as JSON."""
        obs = _as_dict(observation)
        field = self.config.get("observation_field")
        if field:
            if field not in obs:
                raise KeyError(f"observation has no field {field!r} (it has {sorted(obs)})")
            return str(obs[field])
        shown = {k: v for k, v in obs.items() if k not in _HIDDEN}
        texts = [v for v in shown.values() if isinstance(v, str)]
        if len(shown) == 1 and texts:
            return texts[0]
        return json.dumps(shown, sort_keys=True, default=str)

    @staticmethod
    def _metadata(result: Any) -> dict[str, Any]:
        metadata = getattr(result, "metadata", None)
        if metadata is None:
            metadata = _as_dict(result.observation).get("metadata")
        return dict(metadata or {})

    def close(self, request: dict[str, Any] | None = None) -> dict[str, Any]:
        """Close the session's client; without a session, every client and the server (it is
        killed if it does not stop in 5 s)."""
        session = (request or {}).get("session")
        if session is not None:
            client = self.sessions.pop(str(session), None)
            if client is not None:
                client.close()
            return {}
        try:
            for client in list(self.sessions.values()):
                client.close()
        finally:
            self.sessions.clear()
            if self.server is not None and self.server.poll() is None:
                self.server.terminate()
                try:
                    self.server.wait(5)
                except subprocess.TimeoutExpired:
                    self.server.kill()
        return {}


def _answer(bridge: Bridge, request: dict[str, Any], out: Any, lock: threading.Lock) -> None:
    """Run one request and write its reply (with the request's ``id``)."""
    op = request.get("op")
    try:
        if op not in ("start", "reset", "step", "close"):
            raise ValueError(f"unknown op {op!r}")
        reply = {"ok": True, **getattr(bridge, op)(request)}
    except Exception as e:  # noqa: BLE001 - every failure is the reply's error
        reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    with lock:
        out.write(json.dumps({**reply, "id": request.get("id")}, default=str) + "\n")
        out.flush()


def main() -> None:
    """Serve requests from stdin until a ``close`` without a session, or end of input;
    ``start`` and ``close`` run in order, the sessions' ``reset`` / ``step`` in threads."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything the environment prints goes to stderr, not into the protocol
    sys.stdout = sys.stderr
    bridge, lock = Bridge(), threading.Lock()
    with ThreadPoolExecutor(max_workers=64) as pool:
        for line in sys.stdin:
            request = json.loads(line)
            if request.get("op") in ("reset", "step") or request.get("session") is not None:
                pool.submit(_answer, bridge, request, out, lock)
                continue
            _answer(bridge, request, out, lock)
            if request.get("op") == "close":
                return
        bridge.close()


if __name__ == "__main__":
    main()
