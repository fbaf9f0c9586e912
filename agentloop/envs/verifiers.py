"""verifiers environments rolled out through a gateway session (docs/environments.md#verifiers).

verifiers 0.4.0 pins ``openai`` 2.x and ``mcp`` 2.0, older than what the engine's venv holds, so it
lives in its own virtualenv (``make verifiers-env`` -> ``.venv-verifiers``) and runs out of process:
:class:`VerifiersAgentLoop` is an ``openai_agent`` loop whose runner starts
``agentloop/envs/verifiers_runner.py`` with that venv's interpreter once per sample. The script
loads the environment (``vf.load_environment``), runs one episode of the sample's task with the
client's ``base_url`` set to the sample's gateway session (so every model call is recorded with
exact tokens) and writes the reward verifiers' rubric gave; the runner returns it as the session's
reward (``{"score": ...}``). An environment that fails is the row's ``error``, with its message.

Loop entry (``agent_loop_config_path``)::

    - name: verifiers_sum
      _target_: agentloop.envs.verifiers.VerifiersAgentLoop
      env: {taskset: {id: verifiers_env, num_tasks: 8}}   # vf.resolve_env_config input
      path: [examples/environments]                       # PYTHONPATH of the runner
      python: .venv-verifiers/bin/python                  # the default

Rows: ``agent_name: verifiers_sum`` and ``extra_info.verifiers``: ``{"idx": 3}`` (the taskset's
task at that position) or ``{"task": {...TaskData fields}}`` (``prompt`` defaults to the row's).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from agentloop.errors import ConfigError
from agentloop.loops.openai_agent import OpenAIAgentLoop
from agentloop.loops.runners import AgentRunner
from agentloop.types import MultiTrajectoryAgentLoopOutput
from agentloop.utils.process import start_process, wait_process

__all__ = [
    "DEFAULT_PYTHON", "MAKE_TARGET", "RUNNER_SCRIPT", "VerifiersAgentLoop", "VerifiersEnvError",
    "check_verifiers_entry", "verifiers_runner",
]

DEFAULT_PYTHON = ".venv-verifiers/bin/python"
"""The verifiers venv's interpreter (relative paths are taken from the working directory)."""
MAKE_TARGET = "make verifiers-env"
RUNNER_SCRIPT = Path(__file__).with_name("verifiers_runner.py")
REQUEST_VAR = "AGENTLOOP_VERIFIERS_REQUEST"
_LOCAL_RUNTIME = {"type": "subprocess"}
"""The agent runtime used when the env config names none: verifiers' default (Prime sandboxes)
needs an account and a tunnel; the harness runs next to the runner instead."""


class VerifiersEnvError(RuntimeError):
    """The verifiers environment failed for one sample (the row's ``error``)."""


def _plain(value: Any) -> Any:
    """YAML values (OmegaConf containers) as plain dicts and lists."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _env_config(env: Any) -> dict[str, Any]:
    """The verifiers env config, with a local agent runtime unless it names one."""
    config = dict(_plain(env) or {})
    taskset = config.get("taskset")
    if not isinstance(taskset, Mapping) or not taskset.get("id"):
        raise ConfigError("verifiers loop: 'env' needs a taskset id, e.g. env: {taskset: {id: "
                          f"verifiers_env}} (got {env!r})")
    agent = dict(config.pop("agent", None) or {})  # verifiers' own key, not the rollout config's
    agent.setdefault("runtime", dict(_LOCAL_RUNTIME))
    return {**config, "agent": agent}


def check_verifiers_entry(kwargs: Mapping[str, Any], name: str = "verifiers") -> None:
    """Refuse a loop entry whose verifiers venv is missing or lacks verifiers, or whose ``env``
    names no taskset (one line naming the fix).

    Raises:
        ConfigError: as above.
    """
    _env_config(kwargs.get("env"))
    python = str(kwargs.get("python") or DEFAULT_PYTHON)
    how = f"create it with `{MAKE_TARGET}` (verifiers==0.4.0 in .venv-verifiers)"
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ConfigError(f"agent loop {name!r}: no verifiers virtualenv interpreter at "
                          f"{python!r}; {how}, or set the entry's 'python'")
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('verifiers') is None)"
    if subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode:
        raise ConfigError(f"agent loop {name!r}: {python!r} has no verifiers package; {how}")


def _request(env: dict[str, Any], base_url: str, model: str, fields: Mapping[str, Any],
             raw_prompt: list[dict[str, Any]], result: str) -> dict[str, Any]:
    """The runner's request for one sample (its task from ``extra_info.verifiers``)."""
    extra = fields.get("extra_info")
    spec = extra.get("verifiers") if isinstance(extra, Mapping) else None
    spec = dict(_plain(spec) or {})
    task = spec.get("task")
    if isinstance(task, Mapping):
        task = {"prompt": raw_prompt, **_plain(task)}
    return {"base_url": base_url, "model": model, "env": env, "task": task,
            "idx": spec.get("idx"), "result": result}


def verifiers_runner(env: Any, *, python: str = DEFAULT_PYTHON, path: Any = None,
                     model: str = "policy") -> AgentRunner:
    """An agent runner that runs one verifiers episode per sample in the verifiers venv.

    Args:
        env: the verifiers env config (``{"taskset": {"id": ..., ...}, "agent": ...}``).
        python: the venv's interpreter. path: directories put on the runner's ``PYTHONPATH``
            (where the taskset's module is). model: the model name the harness sends.

    Returns:
        ``runner(*, base_url, api_key, raw_prompt, **fields) -> {"score": reward, ...}``; it raises
        :class:`VerifiersEnvError` with the environment's message when the episode fails.
    """
    config = _env_config(env)
    paths = [str(Path(p).absolute()) for p in (_plain(path) or [])]
    # -P: the script's directory (agentloop/envs, holding this verifiers.py) is not put on sys.path
    argv = [str(Path(python).absolute()), "-P", str(RUNNER_SCRIPT)]
    label = str(config["taskset"]["id"])

    async def run(*, base_url: str, api_key: str, raw_prompt: list[dict[str, Any]],
                  **fields: Any) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="agentloop-vf-") as tmp:
            result_path = os.path.join(tmp, "result.json")
            request = _request(config, base_url, model, fields, list(raw_prompt), result_path)
            child_env = {**os.environ, REQUEST_VAR: json.dumps(request, default=str),
                         "OPENAI_API_KEY": api_key, "OPENAI_BASE_URL": base_url,
                         "PYTHONPATH": os.pathsep.join(paths)}
            with open(os.path.join(tmp, "stderr"), "w+b") as stderr:
                code = await wait_process(await start_process(argv, child_env, stderr))
                stderr.seek(max(0, stderr.seek(0, os.SEEK_END) - 800))
                tail = stderr.read().decode(errors="replace").strip()
            try:
                with open(result_path, encoding="utf-8") as f:
                    result = json.load(f)
            except (OSError, ValueError):
                result = {"error": f"the runner exited with {code} and wrote no result: {tail}"}
        if code != 0 or "error" in result:
            raise VerifiersEnvError(f"verifiers environment {label!r}: "
                                    f"{result.get('error') or tail}")
        return {"score": float(result["reward"]), **result}

    return run


class VerifiersAgentLoop(OpenAIAgentLoop):
    """An ``openai_agent`` loop whose agent is a verifiers environment run in its own venv.

    Entry kwargs: ``env`` (required), ``python``, ``path``, ``model`` (see
    :func:`verifiers_runner`), plus ``openai_agent``'s gateway overrides (``session_timeout``,
    ``trajectories``, ``reward_to``). :meth:`check_entry` runs before any engine starts.
    """

    def __init__(self, trainer_config: Any, server_manager: Any, tokenizer: Any,
                 processor: Any | None = None, **kwargs: Any) -> None:
        runner = verifiers_runner(kwargs.get("env"), python=kwargs.get("python") or DEFAULT_PYTHON,
                                  path=kwargs.get("path"), model=kwargs.get("model") or "policy")
        rest = {k: v for k, v in kwargs.items() if k not in ("env", "python", "path", "model")}
        super().__init__(trainer_config, server_manager, tokenizer, processor,
                         **{**rest, "runner": runner})
        self.env_label = f"verifiers/{_env_config(kwargs.get('env'))['taskset']['id']}"

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any
                  ) -> MultiTrajectoryAgentLoopOutput:
        """``openai_agent``'s run; each row's ``env`` column is ``verifiers/<taskset id>`` (the
        summary's ``reward_by_env``)."""
        out = await super().run(sampling_params, **kwargs)
        for traj in out.trajectories:
            traj.extra_fields["env"] = self.env_label
        return out

    @classmethod
    def check_entry(cls, kwargs: Mapping[str, Any], name: str = "verifiers") -> None:
        """The entry's start-up check (:func:`check_verifiers_entry`)."""
        check_verifiers_entry(kwargs, name)
