"""Run one verifiers episode against an agentloop gateway session (runs in the verifiers venv).

This file is a script for the interpreter of the virtualenv that holds ``verifiers`` (made by
``make verifiers-env``); it imports only the standard library and verifiers, never agentloop.
:mod:`agentloop.envs.verifiers` starts it once per sample with:

* ``AGENTLOOP_VERIFIERS_REQUEST``: JSON ``{"base_url", "model", "env", "task", "idx",
  "result"}``: the session's OpenAI base URL, the model name to send, the verifiers env config
  (``vf.resolve_env_config`` input: ``{"taskset": {"id": ..., **its config}, "agent": ...}``), the
  task as TaskData fields (``task``) or its position in the taskset (``idx``), and the path of the
  result file;
* ``OPENAI_API_KEY``: the session key (the client config's ``api_key_var``).

It loads the environment with ``vf.load_environment``, runs ONE episode of that task with the
client pointed at the session (every model call of the harness goes to the gateway), and writes
``{"reward", "rewards", "metrics", "num_traces"}`` (the last trace's reward, as verifiers' rubric
scored it) or ``{"error": message}`` to the result file. Exit code 0 on success, 1 on an error.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback
from typing import Any

REQUEST_VAR = "AGENTLOOP_VERIFIERS_REQUEST"
KEY_VAR = "OPENAI_API_KEY"


class EpisodeError(Exception):
    """The environment failed: its message is the row's error."""


def _task(vf: Any, env: Any, request: dict[str, Any]) -> Any:
    """The task of the request: built from ``task`` (TaskData fields) or found by ``idx``."""
    fields = request.get("task")
    if isinstance(fields, dict):
        task_cls = type(env.taskset).task_type()
        data = task_cls.data_type().model_validate(fields)
        if env.taskset.system_prompt is not None and data.system_prompt is None:
            data = data.model_copy(update={"system_prompt": env.taskset.system_prompt})
        return task_cls(data, env.taskset.config.task)
    idx = request.get("idx")
    if not isinstance(idx, int) or isinstance(idx, bool) or idx < 0:
        raise EpisodeError(f"the sample names no task: give extra_info.verifiers.task (TaskData "
                           f"fields) or extra_info.verifiers.idx (a position), got idx={idx!r}")
    for task in env.taskset:
        if task.data.idx == idx:
            return task
        if task.data.idx is not None and task.data.idx > idx:
            break
    raise EpisodeError(f"taskset {env.config.taskset.id!r} has no task idx {idx}")


def _failure(episode: Any) -> str | None:
    """The first error of the episode or of its traces, as ``Type: message``; None if ok."""
    errors = list(episode.errors)
    for trace in episode.traces:
        errors.extend(trace.errors)
    if errors:
        first = errors[0]
        return f"{first.type}: {first.message}"
    if not episode.ok:
        return "the episode did not complete (no error recorded)"
    return None


async def run_episode(request: dict[str, Any]) -> dict[str, Any]:
    """Load the env, run the request's task once against the session, return the result."""
    import verifiers.v1 as vf  # the verifiers venv's package: this script runs only there

    env = vf.load_environment(vf.resolve_env_config(request["env"]))
    task = _task(vf, env, request)
    client = vf.EvalClientConfig(base_url=request["base_url"], api_key_var=KEY_VAR)
    ctx = vf.ModelContext(model=str(request.get("model") or "policy"), client=client)
    async with env.serving():
        episode = await env.run_episode(task, ctx)
    failed = _failure(episode)
    if failed:
        raise EpisodeError(failed)
    last = episode.traces[-1]
    return {
        "reward": float(last.reward),
        "rewards": {k: (None if r is None else r.score) for k, r in last.rewards.items()},
        "metrics": dict(last.metrics),
        "num_traces": len(episode.traces),
    }


def main() -> int:
    """Read the request, run it, write the result file; 0 on success, 1 on an error."""
    request = json.loads(os.environ[REQUEST_VAR])
    try:
        result: dict[str, Any] = asyncio.run(run_episode(request))
        code = 0
    except EpisodeError as e:
        result, code = {"error": str(e)}, 1
    except Exception as e:  # noqa: BLE001 - any failure of the env is the row's error message
        traceback.print_exc()
        result, code = {"error": f"{type(e).__name__}: {e}"}, 1
    with open(request["result"], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return code


if __name__ == "__main__":
    sys.exit(main())
