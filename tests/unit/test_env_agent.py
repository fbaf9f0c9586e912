"""EnvAgentLoop against scripted environments and ScriptedServer scripts (no Ray, no engine)."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf

from agentloop.batch.protocol import DataProto
from agentloop.cli.failures import EXIT_BAD_INPUT
from agentloop.cli.summary import rewards_by, summary_rows
from agentloop.config import EnvConfig, default_config
from agentloop.envs import ENVS, AssistantTurn, EnvReset, EnvStep, register_env
from agentloop.envs.resolve import batch_rows, check_env_samples, resolve_env
from agentloop.errors import ConfigError
from agentloop.loops import env_agent
from agentloop.loops.env_agent import EnvAgentLoop
from agentloop.rollout.worker import AgentLoopWorker
from agentloop.routing import AsyncLLMServerManager
from agentloop.testing import FakeTokenizer, ScriptedServer
from agentloop.testing.fake_tokenizer import IM_END
from agentloop.testing.templates import STOP_TOKENS, make_template_tokenizer
from agentloop.trace import configure

TOK = FakeTokenizer()
SEEN: list[Any] = []
CLOSED: list[str] = []


class Guess:
    """Guess a number: each wrong guess gets 'higher'/'lower' and reward -0.1; right ends it."""

    def __init__(self, target: int = 7, fail: str = "", score: float | None = None) -> None:
        self.target, self.fail, self.score = target, fail, score

    def reset(self, sample: dict[str, Any]) -> EnvReset:
        if self.fail == "reset":
            raise ValueError("no puzzle today")
        SEEN.append(("reset", sample.get("extra_info")))
        return EnvReset([{"role": "system", "content": "Guess."},
                         {"role": "user", "content": "A number from 1 to 9?"}], info={"level": 1})

    def step(self, turn: AssistantTurn) -> EnvStep:
        SEEN.append(turn)
        if self.fail == "step":
            raise RuntimeError("engine room on fire")
        if self.fail == "slow":
            time.sleep(2)
        guess = int(turn.content.strip() or 0)
        if guess == self.target:
            info = {"score": self.score} if self.score is not None else {}
            return EnvStep([], reward=1.0, done=True, info=info)
        hint = "higher" if guess < self.target else "lower"
        return EnvStep([{"role": "user", "content": hint}], reward=-0.1)

    def close(self) -> None:
        CLOSED.append("guess")


class AsyncTools:
    """An async environment that answers tool calls with tool messages."""

    def __init__(self, huge: bool = False) -> None:
        self.huge = huge

    async def reset(self, sample: dict[str, Any]) -> EnvReset:
        tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
        return EnvReset([{"role": "user", "content": "Add 2 and 3."}], tools=tools)

    async def step(self, turn: AssistantTurn) -> EnvStep:
        SEEN.append(turn)
        if not turn.tool_calls:
            return EnvStep([], reward=float(turn.content.strip() == "5"), done=True)
        call = turn.tool_calls[0]
        result = "x" * 5000 if self.huge else str(sum(call["arguments"].values()))
        return EnvStep([{"role": "tool", "content": result, "tool_call_id": call["id"]}])

    async def close(self) -> None:
        CLOSED.append("tools")


register_env("test_guess")(Guess)
register_env("test_tools")(AsyncTools)


@pytest.fixture(autouse=True)
def _clean():
    SEEN.clear()
    CLOSED.clear()
    yield


def say(text: str) -> list[int]:
    return TOK.encode(text) + [IM_END]


def call(name: str, **args: Any) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": args})}</tool_call>'


def rollout_cfg(response_length: int = 400, **env: Any):
    cfg = default_config()
    cfg.data.max_prompt_length = 256
    cfg.data.max_response_length = response_length
    OmegaConf.resolve(cfg)
    for k, v in env.items():
        cfg.actor_rollout_ref.rollout.env[k] = v
    return cfg.actor_rollout_ref.rollout


def run_env(script: list, env: Any, response_length: int = 400, **env_cfg: Any):
    rollout = rollout_cfg(response_length, **env_cfg)
    server = ScriptedServer(script, eos_token_id=IM_END)

    async def go():
        EnvAgentLoop.init_class(rollout, TOK)
        loop = EnvAgentLoop(rollout, AsyncLLMServerManager([server]), TOK)
        return await loop.run({"logprobs": True}, raw_prompt=[], extra_info={"env": env})

    return asyncio.run(go()), server


def conversation_render(out, server) -> None:
    """prompt + every turn's tokens equal the chat template's render of the whole conversation."""
    assert out.prompt_ids + out.response_ids[: len(server.calls[-1]["prompt_ids"]) - len(
        out.prompt_ids)] == server.calls[-1]["prompt_ids"]


def test_multi_step_episode_rewards_per_turn_and_final_sum():
    out, server = run_env([say("3"), say("9"), say("7")], "test_guess")
    assert out.status == "stop" and out.num_turns == 6 and out.error is None
    assert out.extra_fields["turn_scores"] == [-0.1, -0.1, 1.0]
    assert out.reward_score == pytest.approx(0.8)
    assert out.extra_fields["env"] == "test_guess" and out.extra_fields["env_info"] == {"level": 1}
    assert [t.content for t in SEEN[1:]] == ["3", "9", "7"] and CLOSED == ["guess"]
    # exact tokens: the prompt plus every turn is the template's render of the whole conversation
    messages = [{"role": "system", "content": "Guess."},
                {"role": "user", "content": "A number from 1 to 9?"},
                {"role": "assistant", "content": "3"}, {"role": "user", "content": "higher"},
                {"role": "assistant", "content": "9"}, {"role": "user", "content": "lower"},
                {"role": "assistant", "content": "7"}]
    whole = TOK.apply_chat_template(messages)
    assert out.prompt_ids + out.response_ids == whole[:-1]  # the render's trailing "\n" follows
    mask = out.response_mask
    assert sum(mask) == 3 * len(say("3")) and out.response_logprobs[mask.index(0)] == 0.0
    conversation_render(out, server)


def test_final_score_from_the_last_steps_info_wins_over_the_sum():
    out, _ = run_env([say("1"), say("7")], {"name": "test_guess", "score": 0.5})
    assert out.extra_fields["turn_scores"] == [-0.1, 1.0] and out.reward_score == 0.5


def test_done_on_the_first_step():
    out, server = run_env([say("7")], {"_target_": f"{__name__}.Guess", "name": "mine"})
    assert out.status == "stop" and out.num_turns == 2 and len(server.calls) == 1
    assert out.reward_score == 1.0 and out.extra_fields["env"] == "mine"
    assert out.response_mask == [1] * len(say("7"))


def test_tool_calls_are_handed_to_the_environment_and_tool_turns_exact():
    out, server = run_env([say(call("add", a=2, b=3)), say("5")], "test_tools")
    turn = SEEN[0]
    assert turn.tool_calls[0]["name"] == "add"
    assert turn.tool_calls[0]["arguments"] == {"a": 2, "b": 3}
    assert "<tool_call>" in turn.text and out.extra_fields["num_tool_calls"] == 1
    assert out.status == "stop" and out.reward_score == 1.0 and CLOSED == ["tools"]
    sent = server.calls[1]["prompt_ids"]
    assert TOK.decode(sent).endswith("<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")
    conversation_render(out, server)


def test_an_observation_over_the_budget_ends_with_length():
    out, server = run_env([say(call("add", a=1)), say("never")], {"name": "test_tools",
                                                                   "huge": True}, 200)
    assert out.status == "length" and len(server.calls) == 1 and 0 not in out.response_mask
    assert CLOSED == ["tools"]


def test_max_turns():
    out, _ = run_env([say("1"), say("2"), say("3")], "test_guess", max_turns=2)
    assert out.status == "max_turns" and out.extra_fields["turn_scores"] == [-0.1, -0.1]


@pytest.mark.parametrize("where", ["reset", "step"])
def test_an_environment_exception_is_an_error_row_naming_it(where):
    out, _ = run_env([say("3")], {"name": "test_guess", "fail": where})
    assert out.status == "error" and "'test_guess'" in out.error
    assert ("no puzzle today" if where == "reset" else "engine room on fire") in out.error
    assert ("ValueError" if where == "reset" else "RuntimeError") in out.error
    assert out.reward_score is None and CLOSED == ["guess"]  # close() ran anyway
    assert (out.prompt_ids == []) == (where == "reset")


def test_a_step_timeout_is_a_timeout_row():
    out, _ = run_env([say("3")], {"name": "test_guess", "fail": "slow"}, step_timeout=0.2)
    assert out.status == "timeout" and "'test_guess'" in out.error
    assert "step 1 timed out" in out.error
    assert "env.step_timeout" in out.error and CLOSED == ["guess"]


def test_each_step_is_a_trace_span(tmp_path):
    path = tmp_path / "spans.jsonl"
    configure("jsonl", path=str(path))
    try:
        run_env([say("3"), say("7")], "test_guess")
    finally:
        configure("none")
    names = [json.loads(line)["name"] for line in path.read_text().splitlines()]
    assert names.count("env_step") == 2 and names.count("env_reset") == 1


def test_unknown_env_is_refused_with_did_you_mean():
    cfg = EnvConfig.from_rollout(rollout_cfg())
    with pytest.raises(ConfigError, match="did you mean 'test_guess'"):
        resolve_env("test_gues", cfg)
    rows = batch_rows({"agent_name": ["env_agent"], "extra_info": [{"env": "nope_env"}]}, "x")
    with pytest.raises(ConfigError, match="row 0: unknown environment 'nope_env'"):
        check_env_samples(rows, cfg)
    with pytest.raises(ConfigError) as e:
        run_env([say("1")], "test_gues")
    assert "\n" not in str(e.value)


def test_bad_env_config_and_bad_import_are_refused_in_one_line():
    cfg = EnvConfig.from_rollout(rollout_cfg())
    with pytest.raises(ConfigError, match="bad config .*'colour'.*takes \\['target', 'fail'"):
        resolve_env({"name": "test_guess", "colour": "red"}, cfg)
    with pytest.raises(ConfigError, match="cannot import 'no_such_pkg.Env'"):
        resolve_env({"_target_": "no_such_pkg.Env"}, cfg)
    # rows of other loops are not checked; a sample naming no environment is
    check_env_samples(batch_rows({"raw_prompt": [[]]}, "single_turn_agent"), cfg)
    with pytest.raises(ConfigError, match="names no environment"):
        check_env_samples(batch_rows({"raw_prompt": [[]]}, "env_agent"), cfg)


def test_config_path_and_default(tmp_path):
    path = tmp_path / "envs.yaml"
    path.write_text(f"- name: easy\n  _target_: {__name__}.Guess\n  target: 2\n")
    rollout = rollout_cfg(config_path=str(path), default="easy")
    cfg = EnvConfig.from_rollout(rollout)
    assert resolve_env("easy", cfg).make().target == 2
    server = ScriptedServer([say("2")], eos_token_id=IM_END)

    async def go():
        EnvAgentLoop.init_class(rollout, TOK)
        loop = EnvAgentLoop(rollout, AsyncLLMServerManager([server]), TOK)
        return await loop.run({}, raw_prompt=[])  # no env named: env.default

    out = asyncio.run(go())
    assert out.reward_score == 1.0 and out.extra_fields["env"] == "easy"
    with pytest.raises(ConfigError, match="env.max_turns=0"):
        EnvConfig.from_rollout(rollout_cfg(max_turns=0))


def test_registry_names_and_the_adapters_named_before_their_modules_are_imported():
    assert "test_guess" in ENVS and ENVS["test_guess"] is Guess
    code = ("import sys; from agentloop.envs import ENVS; "
            "print(sorted(ENVS.names()), 'agentloop.envs.skyrl' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert proc.stdout.strip() == ("['openenv', 'reasoning_gym', 'skyrl_gym', 'subprocess', "
                                   "'textarena'] False")


def test_agentloop_rollout_refuses_an_unknown_env_before_anything_starts(model_dir, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "agent_name": "env_agent",
             "extra_info": {"env": "test_gues"}}]
    path = tmp_path / "envs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run(
        [sys.executable, "-m", "agentloop.cli.rollout", "rollout",
         f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={path}",
         f"output_dir={tmp_path / 'out'}"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    assert proc.returncode == EXIT_BAD_INPUT and proc.stdout == "", proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("agentloop: error: row 0: unknown environment 'test_gues'")
    assert "register_env" in line and "Ray" not in proc.stderr


def test_through_the_worker_rows_carry_rewards_env_and_error_messages():
    cfg = default_config()
    cfg.data.max_prompt_length = 128
    cfg.data.max_response_length = 64
    OmegaConf.resolve(cfg)
    worker = AgentLoopWorker.from_slices(
        cfg.actor_rollout_ref.rollout, OmegaConf.create({"path": "unused"}),
        [ScriptedServer([say("7"), say("7")], eos_token_id=IM_END)], tokenizer=TOK,
        trainer_config=cfg,
    )
    envs = ["test_guess", {"name": "test_guess", "fail": "step"}, "no_such_env"]
    col = lambda values: np.array(values, dtype=object)  # noqa: E731
    prompts = np.empty(3, dtype=object)
    prompts[:] = [[] for _ in envs]
    batch = DataProto(batch=None, non_tensor_batch={
        "raw_prompt": prompts, "uid": col(["a", "b", "c"]), "index": np.arange(3),
        "agent_name": col(["env_agent"] * 3), "extra_info": col([{"env": e} for e in envs]),
    }, meta_info={})
    out = asyncio.run(worker.generate_sequences(batch))
    nt = out.non_tensor_batch
    assert nt["status"].tolist() == ["stop", "error", "error"]
    assert out.batch["rm_scores"].sum(-1).tolist()[0] == 1.0
    assert nt["env"].tolist()[:2] == ["test_guess", "test_guess"]
    assert "engine room on fire" in nt["error"][1] and "'no_such_env'" in nt["error"][2]
    assert nt["turn_scores"][0] == [1.0]
    # `agentloop rollout`'s summary: rewards per environment
    assert rewards_by(out, "env") == {"test_guess": {"mean": 1.0, "rows_scored": 1}}
    assert ("reward by env", "test_guess 1.000 (1)") in summary_rows(out, 1.0, 3)


class Odd(Guess):
    """Returns what the protocol does not allow, or fails in close()."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def step(self, turn: AssistantTurn) -> Any:
        if self.what == "tuple":
            return [], 1.0, True, {}
        if self.what == "reward":
            return EnvStep([], reward="lots")
        return super().step(turn)

    def close(self) -> None:
        if self.what == "close":
            raise OSError("socket gone")


register_env("test_odd")(Odd)


@pytest.mark.parametrize("what,expected", [
    ("tuple", "step 1 returned tuple, expected an EnvStep"),
    ("reward", "step 1 returned reward 'lots', expected a number"),
])
def test_a_step_that_breaks_the_protocol_is_an_error_row(what, expected):
    out, _ = run_env([say("3")], {"name": "test_odd", "what": what})
    assert out.status == "error" and out.error == f"environment 'test_odd': {expected}"


def test_a_failing_close_is_kept_and_the_episode_stands():
    out, _ = run_env([say("7")], {"name": "test_odd", "what": "close"})
    assert out.status == "stop" and out.reward_score == 1.0 and out.error is None
    assert "close raised OSError: socket gone" in out.extra_fields["env_close_error"]


def test_a_template_that_rerenders_earlier_turns_snapshots_the_trajectory(monkeypatch):
    def mismatch(*args: Any, **kwargs: Any) -> list[int]:
        raise env_agent.TemplateMismatchError("reasoning dropped")

    monkeypatch.setattr(env_agent, "encode_new_turns", mismatch)
    out, server = run_env([say("3"), say("9"), say("7")], "test_guess")
    rows = out.trajectories
    assert len(rows) == 3 and [r.extra_fields["context_edit"] for r in rows] == [
        "template", "template", None]
    assert [r.reward_score for r in rows[:2]] == [None, None]
    assert rows[-1].reward_score == pytest.approx(0.8) and rows[-1].status == "stop"
    # each new trajectory's prompt is a full render of the conversation so far
    assert TOK.decode(rows[1].prompt_ids).endswith("higher<|im_end|>\n<|im_start|>assistant\n")
    assert all(r.response_mask == [1] * len(say("3")) for r in rows) and CLOSED == ["guess"]
    assert server.calls[2]["prompt_ids"] == rows[2].prompt_ids


@pytest.mark.parametrize("name", ["chatml_hermes", "qwen3", "llama3_json"])
def test_exact_tokens_with_real_chat_templates(name):
    """Every trajectory's prompt + response decodes to the template's render of the conversation
    before its last assistant turn plus that turn (qwen3 drops earlier reasoning: a new trajectory
    per observation)."""
    tok = copy.deepcopy(make_template_tokenizer(name))
    end = tok.convert_tokens_to_ids(STOP_TOKENS[name][0])
    replies = iter([tok.encode(t, add_special_tokens=False) + [end] for t in ("3", "9", "7")])
    server = ScriptedServer(lambda ids, p, rid: next(replies), eos_token_id=end)
    rollout = rollout_cfg()
    rollout.multi_turn.return_messages = True

    async def go():
        EnvAgentLoop.init_class(rollout, tok)
        loop = EnvAgentLoop(rollout, AsyncLLMServerManager([server]), tok)
        return await loop.run({}, raw_prompt=[], extra_info={"env": "test_guess"})

    out = asyncio.run(go())
    rows = getattr(out, "trajectories", [out])
    assert len(rows) == (3 if name == "qwen3" else 1)
    assert rows[-1].status == "stop" and rows[-1].reward_score == pytest.approx(0.8)
    for row in rows:
        messages = row.extra_fields["messages"]
        assert messages[-1]["role"] == "assistant"
        # the conversation before the last assistant turn, as the template renders it with the
        # generation prompt, then what the policy sampled
        before = tok.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        text = tok.decode(row.prompt_ids + row.response_ids)
        assert text == before + messages[-1]["content"] + STOP_TOKENS[name][0]
