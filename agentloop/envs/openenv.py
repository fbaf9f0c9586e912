"""OpenEnv environments under the ``env_agent`` loop, out of process
(docs/environments.md#openenv).

openenv 0.10.0 cannot be installed next to the engine (it needs ``fastmcp<4``, hence ``mcp<2``,
and gradio, hence ``pillow<13``; vLLM's stack has mcp 2.x and pillow 13), so it lives in its own
venv (``make openenv-env`` -> ``.venv-openenv``) and runs there: :class:`OpenEnvEnv` (registered
``openenv``) is a :class:`~agentloop.envs.subprocess_env.SubprocessEnv` whose bridge,
``agentloop/envs/openenv_bridge.py``, starts the OpenEnv server (``uvicorn <app>``, a local
process) or connects to ``base_url``, and drives it with OpenEnv's own client: ``reset`` ->
observation -> the prompt; ``step`` -> the assistant text in the action's ``action_field`` ->
observation, reward, done.

Environment config::

    {name: openenv, app: "openenv_wordenv:app", path: [examples/environments],
     action_field: message, reset_kwargs: {...}}

A row's ``extra_info.openenv`` mapping is added to the ``reset`` keyword arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agentloop.envs.base import register_env
from agentloop.envs.subprocess_env import SubprocessEnv
from agentloop.errors import ConfigError

__all__ = ["BRIDGE_SCRIPT", "DEFAULT_PYTHON", "MAKE_TARGET", "OpenEnvEnv"]

DEFAULT_PYTHON = ".venv-openenv/bin/python"
"""The OpenEnv venv's interpreter (relative paths are taken from the working directory)."""
MAKE_TARGET = "make openenv-env"
BRIDGE_SCRIPT = Path(__file__).with_name("openenv_bridge.py")
_SERVER_KEYS = ("app", "command", "base_url")


@register_env("openenv")
class OpenEnvEnv(SubprocessEnv):
    """One OpenEnv episode: a bridge process in the OpenEnv venv, its server and client.

    Args (exactly one of ``app`` / ``command`` / ``base_url``):
        app: the server's ASGI app, ``module:app`` (``create_app(...)``), started with
            ``python -m uvicorn`` on a free local port.
        command: the server's command instead (a list; ``{port}`` is replaced by the port).
        base_url: a running server to connect to (nothing is started).
        path: directories on the bridge's and server's ``PYTHONPATH`` (the env's module).
        cwd: the server's working directory.
        client: the client class's import path (default OpenEnv's ``GenericEnvClient``).
        action_class: the action type's import path, for a typed client (default: a dict).
        action_field: the action field that gets the assistant text (default ``message``).
        action_text: ``text`` (the decoded turn, default) or ``content`` (without tool calls).
        action_fields: fixed fields added to every action.
        observation_field: the observation field shown to the policy (default: its only text
            field, else all its fields as JSON).
        system: a system message put before the first observation.
        role: the role of observation messages (default ``user``).
        reset_kwargs: keyword arguments of ``reset`` (a row's ``extra_info.openenv`` over them).
        start_timeout: seconds the server has to answer ``/health``. message_timeout: the
            client's per-message timeout.
        python: the OpenEnv venv's interpreter (default ``.venv-openenv/bin/python``).
        pool: one bridge (and server) per worker serving every sample, one client session each,
            instead of a bridge and a server per sample.
    """

    missing_fix = (f"create it with `{MAKE_TARGET}` (openenv==0.10.0 in .venv-openenv), or set "
                   "the env config's 'python'")
    required_module = "openenv"

    def __init__(self, app: str | None = None, command: list[str] | None = None,
                 base_url: str | None = None, path: list[str] | None = None,
                 cwd: str | None = None, client: str | None = None,
                 action_class: str | None = None, action_field: str = "message",
                 action_text: str = "text", action_fields: Mapping[str, Any] | None = None,
                 observation_field: str | None = None, system: str | None = None,
                 role: str = "user", reset_kwargs: Mapping[str, Any] | None = None,
                 start_timeout: float = 60.0, message_timeout: float = 60.0,
                 python: str = DEFAULT_PYTHON, pool: bool = False) -> None:
        config = {
            "app": app, "command": list(command) if command else None, "base_url": base_url,
            "cwd": str(Path(cwd).absolute()) if cwd else None, "client": client,
            "action_class": action_class, "action_field": action_field,
            "action_text": action_text, "action_fields": dict(action_fields or {}),
            "observation_field": observation_field, "system": system, "role": role,
            "reset_kwargs": dict(reset_kwargs or {}), "start_timeout": start_timeout,
            "message_timeout": message_timeout,
        }
        super().__init__(python, str(BRIDGE_SCRIPT), config, path=list(path or []), pool=pool)

    @classmethod
    def check_config(cls, config: Mapping[str, Any]) -> None:
        """The start-up check: one server option, a known ``action_text``, the venv there with
        openenv in it.

        Raises:
            ConfigError: the first problem, in one line naming the fix.
        """
        given = [k for k in _SERVER_KEYS if config.get(k)]
        if len(given) != 1:
            raise ConfigError(f"environment 'openenv': give exactly one of {list(_SERVER_KEYS)} "
                              f"(the server to start, or a running one's URL); got {given}")
        if config.get("action_text", "text") not in ("text", "content"):
            raise ConfigError(f"environment 'openenv': action_text must be 'text' or 'content', "
                              f"got {config.get('action_text')!r}")
        try:
            super().check_config({"python": config.get("python") or DEFAULT_PYTHON})
        except ConfigError as e:
            raise ConfigError(f"environment 'openenv': {e}") from None
