"""The SkyRL-gym adapter against the real skyrl-gym package (gsm8k, gsm8k_multi_turn, offline):
directly, and through EnvAgentLoop on the scripted engine (no Ray, no model)."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest
from omegaconf import OmegaConf

from agentloop.config import EnvConfig, default_config
from agentloop.envs import ENVS, AssistantTurn, resolve_env
from agentloop.envs.skyrl import SkyRLGymEnv, skyrl_extras
from agentloop.errors import ConfigError
from agentloop.loops.env_agent import EnvAgentLoop
from agentloop.routing import AsyncLLMServerManager
from agentloop.testing import FakeTokenizer, ScriptedServer
from agentloop.testing.fake_tokenizer import IM_END

skyrl_gym = pytest.importorskip("skyrl_gym")
from skyrl_gym.envs.base_text_env import BaseTextEnv  # noqa: E402 - after the importorskip
from skyrl_gym.envs.gsm8k import utils as gsm8k_utils  # noqa: E402

TOK = FakeTokenizer()
PROMPT = [{"role": "system", "content": "Solve it."},
          {"role": "user", "content": "Tom has 3 apples and buys 2 more. How many?"}]


def sample(truth: str = "5", **extra_info: Any) -> dict[str, Any]:
    """A sample's fields as the worker hands them to the loop (verl's columns)."""
    return {"raw_prompt": PROMPT, "data_source": "gsm8k", "index": 0, "uid": "u0",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": "test", **extra_info}}


def turn(text: str) -> AssistantTurn:
    return AssistantTurn(text=text, content=text, tool_calls=[])


def say(text: str) -> list[int]:
    return TOK.encode(text) + [IM_END]


class Echo(BaseTextEnv):
    """A user's own SkyRL env, registered through the adapter's entry_point."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.word = (env_config or {}).get("word", "ok")

    def step(self, action: str) -> dict[str, Any]:
        return {"observations": [{"role": "user", "content": f"{self.word}: {action}"}],
                "reward": None, "done": len(action) > 3, "metadata": {"len": len(action),
                                                                        "deep": {"x": 1}}}


def rollout_cfg() -> Any:
    cfg = default_config()
    cfg.data.max_prompt_length = 256
    cfg.data.max_response_length = 400
    OmegaConf.resolve(cfg)
    return cfg.actor_rollout_ref.rollout


def run_loop(replies: list[str], env: Any) -> tuple[Any, ScriptedServer]:
    rollout = rollout_cfg()
    server = ScriptedServer([say(r) for r in replies], eos_token_id=IM_END)

    async def go() -> Any:
        EnvAgentLoop.init_class(rollout, TOK)
        loop = EnvAgentLoop(rollout, AsyncLLMServerManager([server]), TOK)
        fields = sample(max_turns=3)
        fields["extra_info"]["env"] = env
        return await loop.run({"logprobs": True}, **fields)

    return asyncio.run(go()), server


def test_registered_as_skyrl_gym():
    assert ENVS["skyrl_gym"] is SkyRLGymEnv


def test_gsm8k_rewards_equal_the_envs_own_scorer():
    for text in ["The answer is #### 5", "#### 6", "5", "#### 5.0", "#### -5"]:
        env = SkyRLGymEnv("gsm8k")
        reset = env.reset(sample("5"))
        assert reset.messages == PROMPT and reset.tools is None
        step = env.step(turn(text))
        assert step.reward == float(gsm8k_utils.compute_score(text, "5"))
        assert step.done and step.messages == []
        env.close()


def test_gsm8k_multi_turn_equals_the_env_run_directly():
    texts = ["let me think", "#### 4", "#### 5"]
    env = SkyRLGymEnv("gsm8k_multi_turn")
    assert env.reset(sample("5", max_turns=3)).messages == PROMPT
    own = skyrl_gym.make("gsm8k_multi_turn", env_config={},
                         extras=skyrl_extras(sample("5", max_turns=3)))
    own.init(PROMPT)
    for text in texts:
        ours, theirs = env.step(turn(text)), own.step(text)
        assert ours.reward == theirs["reward"] and ours.done == theirs["done"]
        assert ours.messages == theirs["observations"]
        format_score = 0.2 / 3
        assert ours.reward == gsm8k_utils.compute_score(text, "5", method="strict",
                                                        format_score=format_score)
    assert ours.done and ours.info == {"skyrl_steps": 3}


def test_extras_from_the_sample():
    extras = skyrl_extras(sample("7"), {"fixed": 1, "reward_spec": {"ground_truth": "0"}})
    assert extras["reward_spec"] == {"ground_truth": "0"}  # the config's reward_spec stays
    extras = skyrl_extras(sample("7"), {"fixed": 1})
    assert extras["reward_spec"] == {"style": "rule", "ground_truth": "7"} and extras["fixed"] == 1
    assert extras["data_source"] == "gsm8k" and extras["extra_info"]["split"] == "test"
    assert not {"raw_prompt", "index", "uid"} & set(extras)
    own = skyrl_extras({"raw_prompt": PROMPT, "reward_spec": {"ground_truth": "1"},
                        "reward_model": {"ground_truth": "2"}})
    assert own["reward_spec"] == {"ground_truth": "1"} and own["extra_info"] == {}


def test_through_the_loop_turn_scores_are_the_envs_and_tokens_exact():
    out, server = run_loop(["let me think", "#### 4", "#### 5"],
                           {"name": "skyrl_gym", "env_id": "gsm8k_multi_turn"})
    expected = [gsm8k_utils.compute_score(t, "5", method="strict", format_score=0.2 / 3)
                for t in ["let me think", "#### 4", "#### 5"]]
    assert out.status == "stop" and out.error is None, out.error
    assert out.extra_fields["turn_scores"] == expected
    assert out.reward_score == pytest.approx(sum(expected))
    assert out.extra_fields["env"] == "skyrl_gym"
    assert out.extra_fields["env_info"] == {"skyrl_steps": 3}
    # prompt + response = the chat template's render of the whole conversation
    own = skyrl_gym.make("gsm8k_multi_turn", env_config={},
                         extras=skyrl_extras(sample("5", max_turns=3)))
    messages = list(PROMPT)
    for text in ["let me think", "#### 4", "#### 5"]:
        messages.append({"role": "assistant", "content": text})
        messages += own.step(text)["observations"]
    whole = TOK.apply_chat_template(messages)
    assert out.prompt_ids + out.response_ids == whole[:-1]
    assert len(server.calls) == 3
    assert out.response_mask.count(1) == sum(len(say(t)) for t in ["let me think", "#### 4",
                                                                     "#### 5"])


def test_single_turn_gsm8k_through_the_loop():
    out, _ = run_loop(["So #### 5"], {"name": "skyrl_gym", "env_id": "gsm8k"})
    assert out.status == "stop" and out.num_turns == 2 and out.reward_score == 1.0


def test_a_users_env_by_entry_point_unchanged():
    spec = {"name": "skyrl_gym", "env_id": "agentloop_test_echo",
            "entry_point": f"{__name__}:Echo", "env_config": {"word": "heard"}}
    try:
        out, server = run_loop(["hi", "hello"], spec)
    finally:
        skyrl_gym.envs.registration.registry.pop("agentloop_test_echo", None)
    assert out.status == "stop" and out.extra_fields["turn_scores"] == [0.0, 0.0]
    assert out.extra_fields["env_info"]["len"] == 5 and "deep" not in out.extra_fields["env_info"]
    assert TOK.decode(server.calls[1]["prompt_ids"]).endswith(
        "<|im_start|>user\nheard: hi<|im_end|>\n<|im_start|>assistant\n")


def test_refusals_before_any_engine():
    cfg = EnvConfig.from_rollout(rollout_cfg())
    with pytest.raises(ConfigError, match="did you mean 'gsm8k'"):
        resolve_env({"name": "skyrl_gym", "env_id": "gsm8kk"}, cfg)
    assert resolve_env({"name": "skyrl_gym", "env_id": "gsm8k"}, cfg).make().env_id == "gsm8k"
    env = resolve_env("skyrl_gym", cfg).make()  # no env_id: the sample's env_class
    with pytest.raises(ValueError, match="no env_id in the environment config and no env_class"):
        env.reset(sample())
    with pytest.raises(ConfigError, match="did you mean 'gsm8k'"):
        env.reset({**sample(), "env_class": "gsm8kk"})


def test_skyrl_dataset_rows_as_they_are():
    """A row of SkyRL's own dataset format (env_class, reward_spec, no reward_model) under
    env.default: skyrl_gym."""
    row = {"raw_prompt": PROMPT, "env_class": "gsm8k", "data_source": "openai/gsm8k",
           "reward_spec": {"method": "rule", "ground_truth": "5"}, "extra_info": {"split": "x"}}
    env = SkyRLGymEnv()
    assert env.reset(row).messages == PROMPT and env.env_id == "gsm8k"
    assert env.step(turn("#### 5")).reward == 1.0 and env.step(turn("#### 4")).reward == 0.0


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "skyrl_gym", None)  # import skyrl_gym raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'agentloop\[envs\]'") as e:
        SkyRLGymEnv.check_config({"env_id": "gsm8k"})
    assert "\n" not in str(e.value)
