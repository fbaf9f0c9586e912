"""TextArena games (the real package, offline) under env_agent and textarena_selfplay, on scripted
engines: exact tokens, the game's own rewards, illegal moves as the game handles them, games that
end on the first move, errors naming the game."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf

from agentloop.config import EnvConfig, default_config
from agentloop.envs import AssistantTurn
from agentloop.envs.resolve import resolve_env
from agentloop.envs.textarena import (
    GameError,
    TextArenaConfig,
    TextArenaEnv,
    TextArenaGame,
    check_selfplay_samples,
)
from agentloop.errors import ConfigError
from agentloop.loops.env_agent import EnvAgentLoop
from agentloop.loops.textarena_selfplay import TextArenaSelfPlayLoop
from agentloop.rewards.scoring import TrajectoryScorer
from agentloop.routing import AsyncLLMServerManager
from agentloop.testing import FakeTokenizer, ScriptedServer
from agentloop.testing.fake_tokenizer import IM_END
from agentloop.testing.scripted import fake_routed_experts

ta = pytest.importorskip("textarena")

TOK = FakeTokenizer()
SYSTEM = [{"role": "system", "content": "Answer with your move in square brackets."}]


class Boom(ta.Env):
    """A one-player game that raises on its second move, or sleeps on every move."""

    def __init__(self, sleep: float = 0.0) -> None:
        self.sleep = sleep

    def reset(self, num_players: int, seed: int | None = None) -> None:
        self.state = ta.SinglePlayerState(num_players=num_players, seed=seed)
        self.state.reset(game_state={}, player_prompt_function=lambda **_: "Say anything.")

    def step(self, action: str) -> tuple[bool, dict[str, Any]]:
        time.sleep(self.sleep)
        if self.state.turn >= 1:
            raise RuntimeError("the board caught fire")
        self.state.add_observation(message="go on",
                                   observation_type=ta.ObservationType.GAME_MESSAGE)
        return self.state.step()


for _id, _kwargs in (("AgentloopBoom-v0", {}), ("AgentloopSlow-v0", {"sleep": 0.5})):
    if _id not in ta.envs.registration.ENV_REGISTRY:
        ta.register(id=_id, entry_point=Boom, **_kwargs)


def say(text: str) -> list[int]:
    return TOK.encode(text) + [IM_END]


def rollout_cfg(response_length: int = 2048, **env: Any):
    cfg = default_config()
    cfg.data.max_prompt_length = 1024
    cfg.data.max_response_length = response_length
    OmegaConf.resolve(cfg)
    cfg.actor_rollout_ref.rollout.multi_turn.return_messages = True
    for k, v in env.items():
        cfg.actor_rollout_ref.rollout.env[k] = v
    return cfg


def selfplay(moves: list[str], env: Any, response_length: int = 2048, tok: Any = TOK,
             loop_kwargs: dict[str, Any] | None = None, routed: tuple[int, int] | None = None,
             **env_cfg: Any):
    """Play ``moves`` through the loop; ``env`` is the sample's ``extra_info.env`` (a dict gets
    ``name: textarena``)."""
    cfg = rollout_cfg(response_length, **env_cfg)
    replies = [tok.encode(m, add_special_tokens=False) + [tok.eos_token_id] for m in moves]
    server = ScriptedServer(replies, eos_token_id=tok.eos_token_id, routed_experts=routed)
    if isinstance(env, dict):
        env = {"name": "textarena", **env}

    async def go():
        loop = TextArenaSelfPlayLoop(cfg, AsyncLLMServerManager([server]), tok,
                                     **(loop_kwargs or {}))
        return await loop.run({"logprobs": True}, raw_prompt=SYSTEM,
                              extra_info={} if env is None else {"env": env})

    return asyncio.run(go()), server


def raw_game(env_id: str, moves: list[str], num_players: int, seed: int | None = None):
    """The same moves played on textarena directly: (rewards, game_info, observations seen)."""
    env = ta.make(env_id)
    env.reset(num_players=num_players, seed=seed)
    seen = []
    for move in moves:
        seen.append(env.get_observation())
        if env.step(move)[0]:
            break
    return *env.close(), seen


def exact(out) -> None:
    """The trajectory's ids are the chat template's render of its own conversation."""
    rendered = TOK.apply_chat_template(out.extra_fields["messages"], tokenize=True)
    assert out.prompt_ids + out.response_ids + TOK.encode("\n") == rendered


def sampled(out) -> str:
    return TOK.decode([t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m])


# ------------------------------------------------------------------ two players, self-play


def test_tictactoe_selfplay_one_trajectory_per_player_with_the_games_rewards():
    moves = ["[4]", "I take [0]", "[1]", "[3]", "[7]"]
    out, server = selfplay(moves, {"env_id": "TicTacToe-v0", "seed": 1})
    rewards, info, _ = raw_game("TicTacToe-v0", moves, 2, seed=1)
    assert rewards == {0: 1, 1: -1}
    p0, p1 = out.trajectories
    assert [p0.reward_score, p1.reward_score] == [1.0, -1.0] and out.reward_to == "last"
    assert p0.status == p1.status == "stop"
    assert sampled(p0) == "[4]<|im_end|>[1]<|im_end|>[7]<|im_end|>"
    assert sampled(p1) == "I take [0]<|im_end|>[3]<|im_end|>"
    for out_i in (p0, p1):
        exact(out_i)
        assert out_i.extra_fields["game_reason"] == info[0]["reason"] == "Player 0 has won!"
        assert out_i.extra_fields["game_done"] is True
    assert (p0.extra_fields["player_id"], p1.extra_fields["player_id"]) == (0, 1)
    assert p0.num_turns == 6 and p1.num_turns == 4
    assert p0.extra_fields["min_global_steps"] == p0.extra_fields["max_global_steps"] == 0
    # each player's request continues its own conversation; turns stick to one request id per player
    ids = [c["request_id"] for c in server.calls]
    assert ids[0] == ids[2] == ids[4] != ids[1] == ids[3]
    # a player sees the opponent's move but not its own echo (that is its assistant turn)
    second = p1.extra_fields["messages"][1]["content"]
    assert second.startswith("[GAME] You are Player 1") and "[Player 0] [4]" in second
    assert "[Player 0]" not in p0.extra_fields["messages"][3]["content"]
    assert "[Player 1] I take [0]" in p0.extra_fields["messages"][3]["content"]


def test_selfplay_tokens_are_exact_with_the_tiny_models_chat_template(tokenizer):
    moves = ["[4]", "I take [0]", "[1]", "[3]", "[7]"]
    out, _ = selfplay(moves, {"env_id": "TicTacToe-v0", "seed": 1}, tok=tokenizer)
    for player in out.trajectories:
        text = tokenizer.apply_chat_template(player.extra_fields["messages"], tokenize=False)
        ids = player.prompt_ids + player.response_ids
        assert ids + tokenizer.encode("\n", add_special_tokens=False) == tokenizer.encode(
            text, add_special_tokens=False)
    assert [t.reward_score for t in out.trajectories] == [1.0, -1.0]


def test_selfplay_rows_carry_the_engines_routing_for_every_token_it_ran():
    """Routing replay: each seat's row is the scripted engine's routing at every position but a
    trailing observation and the last sampled token (never run), which stay unset (filled)."""
    moves = ["[4]", "[0]", "[1]", "[3]", "[7]"]
    out, server = selfplay(moves, {"env_id": "TicTacToe-v0", "seed": 1}, routed=(2, 2))
    for row in out.trajectories:
        ids = row.prompt_ids + row.response_ids
        last = max(i for i, m in enumerate(row.response_mask) if m) + len(row.prompt_ids)
        assert row.routed_experts is not None and len(row.routed_experts) == last
        np.testing.assert_array_equal(row.routed_experts, fake_routed_experts(ids[:last], 0,
                                                                              (2, 2)))
    assert any("routed_experts_prompt_start" in c["sampling_params"] for c in server.calls)


def test_selfplay_rewards_survive_the_worker_scoring_rule():
    out, _ = selfplay(["[4]", "[0]", "[1]", "[3]", "[7]"], {"env_id": "TicTacToe-v0"})
    scorer = TrajectoryScorer.from_config(rollout_cfg(), TOK)
    scored = asyncio.run(scorer.score(out, {"extra_info": {}}))
    assert [t.reward_score for t in scored] == [1.0, -1.0]


def test_illegal_moves_are_handled_as_the_game_handles_them():
    # player 1 plays an occupied cell (warned, plays again), then again: it loses by the game's rule
    moves = ["[4]", "[4]", "[9]"]
    out, _ = selfplay(moves, {"env_id": "TicTacToe-v0"})
    rewards, info, _ = raw_game("TicTacToe-v0", moves, 2)
    p0, p1 = out.trajectories
    assert (p0.reward_score, p1.reward_score) == (rewards[0], rewards[1]) == (1.0, -1.0)
    assert p1.extra_fields["invalid_move"] is True and p0.extra_fields["invalid_move"] is False
    warning = p1.extra_fields["messages"][3]["content"]
    assert "attempted an invalid move" in warning and "cell 4 is already occupied" in warning
    exact(p0)
    exact(p1)


def test_a_game_that_ends_before_a_player_moves_gives_that_player_its_reward():
    out, _ = selfplay(["no move", "still none"], {"env_id": "TicTacToe-v0"})
    p0, p1 = out.trajectories
    assert (p0.reward_score, p1.reward_score) == (-1.0, 1.0)
    assert p1.response_ids == [] and p1.num_turns == 1
    assert p1.prompt_ids == TOK.apply_chat_template(SYSTEM, add_generation_prompt=True)


def test_one_player_game_ending_on_the_first_move():
    secret = _secret(5)
    out, server = selfplay([f"[{secret}]"], {"env_id": "GuessTheNumber-v0", "num_players": 1,
                                            "seed": 5})
    (only,) = out.trajectories
    assert only.reward_score == 1.0 and only.num_turns == 2 and len(server.calls) == 1
    exact(only)


def _secret(seed: int) -> int:
    """The number GuessTheNumber-v0 picks for ``seed`` (read from textarena's own game)."""
    env = ta.make("GuessTheNumber-v0")
    env.reset(num_players=1, seed=seed)
    return int(env.state.game_state["game_number"])


def test_a_stopped_game_has_no_result():
    out, _ = selfplay(["[4]", "[0]", "[1]"], {"env_id": "TicTacToe-v0"}, max_turns=1)
    p0, p1 = out.trajectories
    assert p0.status == "max_turns" and p1.status == "stop"
    assert p0.reward_score is None and p1.reward_score is None
    assert p0.extra_fields["game_done"] is False
    out, _ = selfplay(["[4]", "[0]", "[1]"], {"env_id": "TicTacToe-v0"}, response_length=300)
    assert "length" in [t.status for t in out.trajectories]
    assert all(t.reward_score is None and len(t.response_ids) <= 300 for t in out.trajectories)


def test_wrapped_observations_are_the_game_wrappers_own_strings():
    moves = ["[4]", "[0]"]
    out, _ = selfplay(moves, {"env_id": "TicTacToe-v0-train", "observation": "wrapped"},
                      max_turns=1)
    _, _, seen = raw_game("TicTacToe-v0-train", moves, 2)
    p0, p1 = out.trajectories
    assert p0.extra_fields["messages"][1]["content"] == seen[0][1]
    assert p1.extra_fields["messages"][1]["content"] == seen[1][1]


def test_game_errors_and_timeouts_name_the_game():
    with pytest.raises(GameError, match="'AgentloopBoom-v0' failed in step: RuntimeError: the"):
        selfplay(["a", "b"], {"env_id": "AgentloopBoom-v0", "num_players": 1})
    with pytest.raises(GameError, match="'AgentloopSlow-v0' did not answer step within"):
        selfplay(["a"], {"env_id": "AgentloopSlow-v0", "num_players": 1}, step_timeout=0.1)
    with pytest.raises(GameError, match="'TicTacToe-v0' failed in reset"):
        selfplay(["a"], {"env_id": "TicTacToe-v0", "num_players": 3})


def test_bad_game_configs_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="did you mean 'TicTacToe-v0'"):
        selfplay([], {"env_id": "TicTacToe-v9"})
    with pytest.raises(ConfigError, match="unknown key 'seeds'; did you mean 'seed'"):
        selfplay([], {"env_id": "TicTacToe-v0", "seeds": 1})
    with pytest.raises(ConfigError, match="observation must be one of new | wrapped"):
        TextArenaConfig.from_dict({"env_id": "TicTacToe-v0", "observation": "all"})
    with pytest.raises(ConfigError, match="agent_name textarena_selfplay"):
        resolve_env({"name": "textarena", "env_id": "TicTacToe-v0", "num_players": 2},
                    rollout_env())


def test_games_by_name_from_the_config_file_or_the_loops_registry_entry(tmp_path):
    moves = ["[4]", "[0]", "[1]", "[3]", "[7]"]
    games = tmp_path / "games.yaml"
    games.write_text("- name: ttt\n  _target_: agentloop.envs.textarena.TextArenaEnv\n"
                     "  env_id: TicTacToe-v0\n- name: other\n  _target_: pkg.Other\n")
    out, _ = selfplay(moves, "ttt", config_path=str(games))
    assert [t.reward_score for t in out.trajectories] == [1.0, -1.0]
    assert [t.extra_fields["env"] for t in out.trajectories] == ["ttt", "ttt"]
    out, _ = selfplay(moves, None, loop_kwargs={"env_id": "TicTacToe-v0"})
    assert out.trajectories[0].extra_fields["env"] == "textarena"
    assert [t.extra_fields["env_id"] for t in out.trajectories] == ["TicTacToe-v0"] * 2
    with pytest.raises(ConfigError, match="environment 'other'"):
        selfplay(moves, "other", config_path=str(games))
    with pytest.raises(ConfigError, match="names environment 'skyrl_gym'"):
        selfplay(moves, {"name": "skyrl_gym"})
    with pytest.raises(ConfigError, match="the sample's environment is 'pkg.Other'"):
        selfplay(moves, {"_target_": "pkg.Other", "env_id": "TicTacToe-v0"})
    out, _ = selfplay(moves, {"_target_": "agentloop.envs.textarena.TextArenaEnv",
                              "env_id": "TicTacToe-v0"})
    assert out.trajectories[0].reward_score == 1.0
    with pytest.raises(ConfigError, match="the sample names no environment"):
        selfplay(moves, None)


def test_selfplay_rows_are_checked_before_anything_runs():
    row = {"agent_name": "textarena_selfplay",
           "extra_info": {"env": {"name": "textarena", "env_id": "TicTacToe-v0"}}}
    bad = {"agent_name": "textarena_selfplay",
           "extra_info": {"env": {"name": "textarena", "env_id": "TicTacToe"}}}
    other = {"agent_name": "env_agent", "extra_info": {"env": {"name": "nope"}}}
    unnamed = {"agent_name": "textarena_selfplay", "extra_info": {}}
    seed_only = {"agent_name": "textarena_selfplay", "extra_info": {"env": {"seed": 3}}}
    check_selfplay_samples([row, other, unnamed, seed_only, row], rollout_env())
    with pytest.raises(ConfigError, match="row 1: textarena env_id 'TicTacToe' is not a"):
        check_selfplay_samples([row, bad], rollout_env())


def rollout_env():
    return EnvConfig.from_root(rollout_cfg())


# ------------------------------------------------------------------ one player, env_agent


def guess(env: TextArenaEnv, text: str):
    return env.step(AssistantTurn(text=text, content=text, tool_calls=[]))


def test_single_player_env_rewards_equal_the_games_own():
    secret = _secret(3)
    moves = ["[1]" if secret != 1 else "[2]", "no number", f"[{secret}]"]
    env = TextArenaEnv(env_id="GuessTheNumber-v0", seed=3)
    reset = env.reset({"raw_prompt": SYSTEM})
    assert reset.messages[0] == SYSTEM[0] and reset.messages[1]["content"].startswith(
        "[GAME] You are Player 0. You are playing Guess The Number.")
    steps = [guess(env, m) for m in moves]
    rewards, info, _ = raw_game("GuessTheNumber-v0", moves, 1, seed=3)
    assert [s.done for s in steps] == [False, False, True]
    assert "higher" in steps[0].messages[0]["content"]
    assert "attempted an invalid move" in steps[1].messages[0]["content"]
    assert steps[-1].reward == rewards[0] == 1 and steps[-1].info["score"] == 1
    assert steps[-1].info["game_reason"] == info[0]["reason"]


def test_single_player_invalid_twice_ends_with_the_games_reward():
    env = TextArenaEnv(env_id="GuessTheNumber-v0", seed=4)
    env.reset({})
    steps = [guess(env, m) for m in ["what", "no idea"]]
    rewards, info, _ = raw_game("GuessTheNumber-v0", ["what", "no idea"], 1, seed=4)
    assert steps[-1].done and steps[-1].reward == rewards[0]
    assert steps[-1].info["invalid_move"] is True is info[0]["invalid_move"]


def test_env_agent_runs_a_textarena_game_with_exact_tokens():
    secret = _secret(7)
    cfg = rollout_cfg()
    rollout = cfg.actor_rollout_ref.rollout
    server = ScriptedServer([say("[1]" if secret != 1 else "[2]"), say(f"[{secret}]")],
                            eos_token_id=IM_END)

    async def go():
        EnvAgentLoop.init_class(rollout, TOK)
        loop = EnvAgentLoop(rollout, AsyncLLMServerManager([server]), TOK)
        return await loop.run({"logprobs": True}, raw_prompt=SYSTEM, extra_info={
            "env": {"name": "textarena", "env_id": "GuessTheNumber-v0", "seed": 7}})

    out = asyncio.run(go())
    assert out.status == "stop" and out.reward_score == 1.0 and out.error is None
    exact(out)


def test_games_keep_their_own_random_state():
    secrets = [_secret(5), _secret(6)]
    random.seed(11)
    expected = [random.random() for _ in range(3)]
    random.seed(11)
    first = random.random()
    games = [TextArenaGame(TextArenaConfig(env_id="GuessTheNumber-v0", seed=s)) for s in (5, 6)]
    for game in games:  # interleaved: each game draws from its own state
        game.reset(1)
    assert [first, random.random(), random.random()] == expected  # the process's random untouched
    for game, secret in zip(games, secrets, strict=True):
        assert game.step(f"[{secret}]") and game.result().rewards == {0: 1.0}
