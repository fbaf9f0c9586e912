"""Out-of-process environments (docs/environments.md#openenv): the ``subprocess`` environment
against a fake bridge run by this interpreter (always), and the ``openenv`` adapter against the
real openenv 0.10.0 in ``.venv-openenv`` with the example environment (skipped without the venv),
both through EnvAgentLoop on the scripted engine."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf

from agentloop.batch.protocol import DataProto
from agentloop.config import EnvConfig, default_config
from agentloop.envs.resolve import check_env_samples, resolve_env
from agentloop.errors import ConfigError
from agentloop.loops.env_agent import EnvAgentLoop
from agentloop.rollout.worker import AgentLoopWorker
from agentloop.routing import AsyncLLMServerManager
from agentloop.testing import FakeTokenizer, ScriptedServer
from agentloop.testing.fake_tokenizer import IM_END

TOK = FakeTokenizer()
ROOT = Path(__file__).resolve().parents[2]
OPENENV_PYTHON = ROOT / ".venv-openenv" / "bin" / "python"
EXAMPLES = ROOT / "examples" / "environments"

FAKE_BRIDGE = textwrap.dedent("""
    import json, os, sys, time
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    config = {}
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        reply = {"ok": True}
        if op == "start":
            config = req["config"]
            print("started", flush=True)  # goes to stderr, not into the protocol
        elif op == "reset":
            word = req["sample"]["extra_info"].get("word", "go")
            reply.update(messages=[{"role": "user", "content": word}], info={"pid": os.getpid()})
        elif op == "step":
            text = req["turn"]["text"]
            if text == "crash":
                sys.stderr.write("the bridge is dying now\\n")
                sys.stderr.flush()
                os._exit(3)
            if text == "hang":
                time.sleep(60)
            if text == "slow":
                time.sleep(0.5)
            if text == "raise":
                reply = {"ok": False, "error": "ValueError: bad move"}
            elif text == "garbage":
                out.write("not json\\n")
                continue
            else:
                reply.update(messages=[{"role": "user", "content": "got " + text}],
                             reward=float(len(text.split())), done="done" in text,
                             info={"last": text})
        elif op == "close":
            open(config["closed_marker"], "w").close()
        reply["id"] = req["id"]
        out.write(json.dumps(reply) + "\\n")
        if op == "close" and "session" not in req:
            break
""")


@pytest.fixture()
def bridge(tmp_path: Path) -> dict[str, Any]:
    """The env spec of a ``subprocess`` environment running the fake bridge."""
    script = tmp_path / "fake_bridge.py"
    script.write_text(FAKE_BRIDGE)
    return {"name": "subprocess", "python": sys.executable, "script": str(script),
            "config": {"closed_marker": str(tmp_path / "closed")}}


def rollout_cfg(step_timeout: float = 30.0) -> Any:
    cfg = default_config()
    cfg.data.max_prompt_length = 256
    cfg.data.max_response_length = 400
    cfg.actor_rollout_ref.rollout.env.step_timeout = step_timeout
    cfg.actor_rollout_ref.rollout.multi_turn.return_messages = True
    OmegaConf.resolve(cfg)
    return cfg.actor_rollout_ref.rollout


def run_loop(replies: list[str], env: Any, step_timeout: float = 30.0,
             **extra_info: Any) -> Any:
    """One episode of ``env`` through EnvAgentLoop, the policy saying ``replies``."""
    rollout = rollout_cfg(step_timeout)
    server = ScriptedServer([TOK.encode(r) + [IM_END] for r in replies], eos_token_id=IM_END)

    async def go() -> Any:
        EnvAgentLoop.init_class(rollout, TOK)
        loop = EnvAgentLoop(rollout, AsyncLLMServerManager([server]), TOK)
        fields = {"raw_prompt": [{"role": "user", "content": "x"}], "index": 0,
                  "extra_info": {"env": env, **extra_info}}
        return await loop.run({}, **fields)

    return asyncio.run(go())


async def episode(replies: list[str], env: Any, step_timeout: float = 30.0,
                  **extra_info: Any) -> Any:
    """One episode on the running event loop (pooled bridges are per loop)."""
    rollout = rollout_cfg(step_timeout)
    server = ScriptedServer([TOK.encode(r) + [IM_END] for r in replies], eos_token_id=IM_END)
    EnvAgentLoop.init_class(rollout, TOK)
    loop = EnvAgentLoop(rollout, AsyncLLMServerManager([server]), TOK)
    fields = {"raw_prompt": [{"role": "user", "content": "x"}], "index": 0,
              "extra_info": {"env": env, **extra_info}}
    return await loop.run({}, **fields)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_subprocess_env_steps_rewards_and_close(bridge: dict[str, Any], tmp_path: Path) -> None:
    out = run_loop(["one two", "a b done"], bridge, word="start")
    assert out.status.value == "stop" and out.error is None
    assert out.extra_fields["turn_scores"] == [2.0, 3.0]
    assert out.reward_score == 5.0
    assert [m["content"] for m in out.extra_fields["messages"]] == ["start", "one two",
                                                                    "got one two", "a b done"]
    assert out.extra_fields["env_info"]["last"] == "a b done"
    assert (tmp_path / "closed").exists()  # close() reached the bridge
    assert out.extra_fields["env_close_error"] is None


def test_subprocess_env_remote_error_is_an_error_row(bridge: dict[str, Any]) -> None:
    out = run_loop(["raise"], bridge)
    assert out.status.value == "error"
    assert out.error == ("environment 'subprocess': step 1 raised RemoteEnvError: "
                         "ValueError: bad move")
    assert out.response_ids  # the tokens so far are kept


def test_subprocess_env_crash_names_exit_code_and_stderr(bridge: dict[str, Any]) -> None:
    out = run_loop(["fine", "crash"], bridge)
    assert out.status.value == "error"
    assert out.error.startswith("environment 'subprocess': step 2 raised BridgeError: the bridge "
                                "(fake_bridge.py) exited with code 3 and did not answer step")
    assert "the bridge is dying now" in out.error and "started" in out.error
    assert out.extra_fields["turn_scores"] == [1.0]


def test_subprocess_env_garbage_reply_is_an_error_row(bridge: dict[str, Any]) -> None:
    out = run_loop(["garbage"], bridge)
    assert out.status.value == "error"
    assert "the bridge wrote a line that is not a reply: b'not json\\n'" in out.error


def test_subprocess_env_timeout_kills_the_bridge(bridge: dict[str, Any]) -> None:
    out = run_loop(["hang"], bridge, step_timeout=5.0)
    assert out.status.value == "timeout"
    assert out.error == ("environment 'subprocess': step 1 timed out after 5s "
                         "(actor_rollout_ref.rollout.env.step_timeout)")
    assert gone(out.extra_fields["env_info"]["pid"])


def test_pooled_bridge_serves_concurrent_episodes_as_sessions(bridge: dict[str, Any]) -> None:
    pooled = {**bridge, "pool": True}

    async def go() -> list[Any]:
        return await asyncio.gather(episode(["one", "two done"], pooled, word="w1"),
                                    episode(["a b done"], pooled, word="w2"))

    first, second = asyncio.run(go())
    assert first.extra_fields["turn_scores"] == [1.0, 2.0] and first.reward_score == 3.0
    assert second.extra_fields["turn_scores"] == [3.0] and second.reward_score == 3.0
    assert first.extra_fields["messages"][0]["content"] == "w1"
    pid = first.extra_fields["env_info"]["pid"]
    assert second.extra_fields["env_info"]["pid"] == pid  # one bridge for both samples
    assert not gone(pid)  # the pooled bridge outlives the episodes (until its loop's process ends)
    os.kill(pid, 9)


def test_pooled_timeout_closes_the_session_not_the_bridge(bridge: dict[str, Any]) -> None:
    pooled = {**bridge, "pool": True}

    async def go() -> list[Any]:
        warm = await episode(["done"], pooled, step_timeout=30.0)
        late = await episode(["slow"], pooled, step_timeout=0.2)
        after = await episode(["x done"], pooled, step_timeout=30.0)
        return [warm, late, after]

    warm, late, after = asyncio.run(go())
    assert late.status.value == "timeout" and "step 1 timed out after 0.2s" in late.error
    assert after.status.value == "stop" and after.reward_score == 2.0
    pid = warm.extra_fields["env_info"]["pid"]
    assert after.extra_fields["env_info"]["pid"] == pid and not gone(pid)
    os.kill(pid, 9)


def test_missing_interpreter_is_refused_before_start(bridge: dict[str, Any]) -> None:
    cfg = EnvConfig.from_rollout(rollout_cfg())
    with pytest.raises(ConfigError, match="no Python interpreter at '/nonexistent/python'"):
        resolve_env({**bridge, "python": "/nonexistent/python"}, cfg)
    rows = [{"agent_name": "env_agent",
             "extra_info": {"env": {"name": "openenv", "app": "m:app",
                                    "python": "/nonexistent/python"}}}]
    with pytest.raises(ConfigError) as e:
        check_env_samples(rows, cfg)
    assert str(e.value) == (
        "row 0: environment 'openenv': no Python interpreter at '/nonexistent/python'; create it "
        "with `make openenv-env` (openenv==0.10.0 in .venv-openenv), or set the env config's "
        "'python'")
    with pytest.raises(ConfigError, match="give exactly one of"):
        resolve_env({"name": "openenv", "app": "m:app", "base_url": "http://x"}, cfg)


needs_openenv = pytest.mark.skipif(not OPENENV_PYTHON.exists(),
                                   reason="no .venv-openenv (make openenv-env)")
WORD_ENV = {"name": "openenv", "app": "openenv_wordenv:app", "path": [str(EXAMPLES)],
            "python": str(OPENENV_PYTHON)}


def direct_rewards(word: str, texts: list[str]) -> list[tuple[float, bool]]:
    """The example environment's own (reward, done) for ``texts``, run in the OpenEnv venv."""
    code = textwrap.dedent(f"""
        import json
        from openenv_wordenv import SayAction, WordEnv
        env = WordEnv()
        env.reset(word={word!r})
        out = []
        for text in {texts!r}:
            obs = env.step(SayAction(message=text))
            out.append((obs.reward, obs.done))
        print(json.dumps(out))
    """)
    done = subprocess.run([str(OPENENV_PYTHON), "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(EXAMPLES)}, timeout=120,
                          check=True)
    return [tuple(x) for x in json.loads(done.stdout.splitlines()[-1])]  # type: ignore[misc]


@needs_openenv
def test_openenv_example_rewards_equal_the_server() -> None:
    texts = ["red", "I say Blue"]
    out = run_loop(texts, WORD_ENV, openenv={"word": "blue"})
    assert out.status.value == "stop", out.error
    expected = direct_rewards("blue", texts)
    assert [(r, True) for r in out.extra_fields["turn_scores"]][-1:] == [expected[-1]]
    assert out.extra_fields["turn_scores"] == [r for r, _ in expected] == [0.0, 1.0]
    assert out.reward_score == 1.0
    contents = [m["content"] for m in out.extra_fields["messages"]]
    assert contents == ["Say the word 'blue'.", "red", "Not quite. Say blue.", "I say Blue"]
    assert out.extra_fields["env_info"] == {"tries": 2, "word": "blue"}
    assert TOK.decode(out.prompt_ids).count("Say the word 'blue'.") == 1


@needs_openenv
def test_openenv_server_that_fails_to_start_is_an_error_row() -> None:
    out = run_loop(["hi"], {**WORD_ENV, "app": "no_such_module:app"})
    assert out.status.value == "error"
    assert out.error.startswith("environment 'openenv': reset raised RemoteEnvError: "
                                "RuntimeError: the OpenEnv server")
    assert "exited with code" in out.error
    assert 'Could not import module "no_such_module"' in out.error  # the server's own output
    assert out.reward_score is None


def bridges() -> set[int]:
    """Pids of running OpenEnv bridges and example servers."""
    found: set[int] = set()
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:  # not a process, or it ended
            continue
        if b"openenv_bridge.py" in cmdline or b"openenv_wordenv:app" in cmdline:
            found.add(int(proc.name))
    return found


@needs_openenv
def test_openenv_timeout_kills_the_bridge_and_its_server() -> None:
    before = bridges()
    out = run_loop(["hi"], WORD_ENV, step_timeout=1.0)  # reset: starting takes longer
    assert out.status.value == "timeout"
    assert out.error == ("environment 'openenv': reset timed out after 1s "
                         "(actor_rollout_ref.rollout.env.step_timeout)")
    assert bridges() <= before


@needs_openenv
def test_openenv_example_config_through_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """The example's env.config_path entry, rows and default env, through AgentLoopWorker."""
    monkeypatch.chdir(ROOT)  # the example's paths are relative to the repository root
    cfg = default_config()
    cfg.data.max_prompt_length = 128
    cfg.data.max_response_length = 256
    cfg.actor_rollout_ref.rollout.env.default = "openenv_word"
    cfg.actor_rollout_ref.rollout.env.config_path = "examples/environments/openenv_envs.yaml"
    OmegaConf.resolve(cfg)
    rows = [json.loads(line) for line in (EXAMPLES / "openenv.jsonl").read_text().splitlines()]
    rows = rows[:2]  # blue, apple; the policy always says "blue"
    server = ScriptedServer([TOK.encode("blue") + [IM_END]] * 4, eos_token_id=IM_END)
    worker = AgentLoopWorker.from_slices(cfg.actor_rollout_ref.rollout,
                                         OmegaConf.create({"path": "unused"}), [server],
                                         tokenizer=TOK, trainer_config=cfg)

    def col(values: list[Any]) -> np.ndarray:
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out

    batch = DataProto(batch=None, non_tensor_batch={
        "raw_prompt": col([r["prompt"] for r in rows]), "uid": col(["a", "b"]),
        "index": np.arange(2), "agent_name": col([r["agent_name"] for r in rows]),
        "extra_info": col([r["extra_info"] for r in rows]),
    }, meta_info={})
    before = bridges()
    out = asyncio.run(worker.generate_sequences(batch))
    started = bridges() - before
    for pid in started:  # the example's pooled bridge and its server
        os.kill(pid, 9)
    assert len(started) == 2
    nt = out.non_tensor_batch
    assert nt["status"].tolist() == ["stop", "stop"], nt["error"].tolist()
    assert nt["turn_scores"].tolist() == [[1.0], [0.0, 0.0, 0.0]]
    assert out.batch["rm_scores"].sum(-1).tolist() == [1.0, 0.0]
    assert nt["env"].tolist() == ["openenv_word", "openenv_word"]
    assert "Answer with the word you are asked to say." in TOK.decode(out.batch["prompts"][0])


@needs_openenv
def test_openenv_pooled_one_bridge_and_server_for_concurrent_samples() -> None:
    before = bridges()
    pooled = {**WORD_ENV, "pool": True}

    async def go() -> list[Any]:
        return await asyncio.gather(episode(["blue"], pooled, openenv={"word": "blue"}),
                                    episode(["no", "apple"], pooled, openenv={"word": "apple"}))

    blue, apple = asyncio.run(go())
    assert blue.extra_fields["turn_scores"] == [1.0], blue.error
    assert apple.extra_fields["turn_scores"] == [0.0, 1.0], apple.error
    assert [m["content"] for m in apple.extra_fields["messages"]][:3] == [
        "Say the word 'apple'.", "no", "Not quite. Say apple."]
    started = bridges() - before
    assert len(started) == 2  # one bridge and its one server, shared by both samples
    for pid in started:
        os.kill(pid, 9)
