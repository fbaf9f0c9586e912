"""multi_turn.reward_to: which trajectories of an episode get its (final trajectory's) reward in
rm_scores."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf

from agentloop.batch.protocol import DataProto
from agentloop.config import default_config
from agentloop.errors import ConfigError
from agentloop.loops.base import AgentLoopBase, ResolvedAgentLoop, resolve_registry
from agentloop.rewards.episode import EpisodeRewardConfig, reward_shares
from agentloop.rewards.loader import RewardFunctionConfig
from agentloop.rewards.scoring import TrajectoryScorer
from agentloop.rollout.worker import AgentLoopWorker
from agentloop.testing import ScriptedServer
from agentloop.testing.fake_tokenizer import IM_END, FakeTokenizer
from agentloop.types import AgentLoopOutput, MultiTrajectoryAgentLoopOutput, RolloutStatus

TOK = FakeTokenizer()
CALLS: list[dict[str, Any]] = []


def episode_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """4.0 for the final trajectory; records which trajectory it was called on."""
    CALLS.append(dict(extra_info or {}))
    return {"score": 4.0, "acc": 1.0}


def failing_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    raise RuntimeError("judge unavailable")


@pytest.fixture(autouse=True)
def _clear_calls():
    CALLS.clear()


def traj(
    score: float | None = None, tools: tuple[float, ...] = (), status=RolloutStatus.STOP, **extra
):
    ids = TOK.encode("The answer is 4.")
    return AgentLoopOutput(
        prompt_ids=[5], response_ids=ids, response_mask=[1] * len(ids), reward_score=score,
        status=status, extra_fields={"tool_rewards": list(tools), **extra},
    )


def score(outputs, fn: str | None = None, add_tools: bool = False, reward_to: str = "all",
          gamma: float = 0.5) -> list[float | None]:
    config = RewardFunctionConfig(path="test_reward_to" if fn else None, name=fn or "compute_score",
                                  add_tool_rewards=add_tools)
    scorer = TrajectoryScorer(config, TOK, 16, EpisodeRewardConfig.checked(reward_to, gamma))
    result = asyncio.run(scorer.score(outputs, {"reward_model": {"ground_truth": "4"}}))
    return [o.reward_score for o in result]


def test_shares():
    assert reward_shares(3, "all") == [1.0, 1.0, 1.0]
    assert reward_shares(3, "last") == [0.0, 0.0, 1.0]
    assert reward_shares(3, "discounted", 0.5) == [0.25, 0.5, 1.0]
    assert reward_shares(1, "last") == [1.0] and reward_shares(1, "discounted", 0.1) == [1.0]


def test_loop_reward_on_the_final_trajectory_is_spread_by_mode():
    """No custom function: the final trajectory's own reward_score is the episode reward."""
    assert score([traj(), traj(), traj(2.0)], reward_to="all") == [2.0, 2.0, 2.0]
    assert score([traj(), traj(), traj(2.0)], reward_to="last") == [0.0, 0.0, 2.0]
    assert score([traj(), traj(), traj(2.0)], reward_to="discounted", gamma=0.5) == [0.5, 1.0, 2.0]
    # a single trajectory is unchanged whatever the mode
    assert score([traj(2.0)], reward_to="last") == [2.0] and score(
        [traj(2.0)], reward_to="discounted"
    ) == [2.0]


def test_own_scores_and_tool_rewards_stay_on_their_trajectory():
    # snapshot 0 earned a turn score of 0.25 and a tool reward of 0.5; the final earned a tool
    # reward of 0.1
    outputs = [traj(0.25, tools=(0.5,)), traj(), traj(2.0, tools=(0.1,))]
    assert score(outputs, add_tools=True, reward_to="last") == [0.75, 0.0, pytest.approx(2.1)]
    outputs = [traj(0.25, tools=(0.5,)), traj(), traj(2.0, tools=(0.1,))]
    assert score(outputs, add_tools=True, reward_to="all") == [2.75, 2.0, pytest.approx(2.1)]
    # no episode reward (the final has none) and no function: each keeps only what it earned
    assert score([traj(0.25), traj(None)], reward_to="all") == [0.25, None]


def test_custom_function_scores_only_the_final_trajectory():
    outputs = [traj(snapshot=True), traj(snapshot=True), traj(snapshot=False)]
    assert score(outputs, fn="episode_score", reward_to="discounted", gamma=0.5) == [1.0, 2.0, 4.0]
    assert [c["snapshot"] for c in CALLS] == [False]  # one call, on the final trajectory
    # the episode's reward extra info is copied to the earlier rows (it describes the episode)
    assert all(o.extra_fields["reward_extra_info"]["acc"] == 1.0 for o in outputs)


def test_a_failed_episode_reward_leaves_every_trajectory_without_reward():
    outputs = [traj(0.25), traj()]
    assert score(outputs, fn="failing_score") == [None, None]
    assert "judge unavailable" in outputs[0].extra_fields["reward_error"]
    assert "final trajectory has none" in outputs[0].extra_fields["reward_error"]
    # the final did not finish: no call, no reward
    outputs = [traj(), traj(status=RolloutStatus.TIMEOUT)]
    assert score(outputs, fn="episode_score") == [None, None] and CALLS == []
    assert "'timeout'" in outputs[0].extra_fields["reward_error"]


def test_episode_override_wins_over_the_config():
    episode = MultiTrajectoryAgentLoopOutput(trajectories=[traj(), traj(3.0)], reward_to="last")
    assert score(episode, reward_to="all") == [0.0, 3.0]
    episode = MultiTrajectoryAgentLoopOutput(
        trajectories=[traj(), traj(3.0)], reward_to="discounted", reward_gamma=1.0 / 3
    )
    assert score(episode, reward_to="all", gamma=0.9) == [pytest.approx(1.0), 3.0]


def test_bad_config_values_fail_with_the_key():
    with pytest.raises(ConfigError, match="multi_turn.reward_to"):
        EpisodeRewardConfig.checked("first", None)
    with pytest.raises(ConfigError, match="multi_turn.reward_gamma"):
        EpisodeRewardConfig.checked("discounted", 1.5)
    cfg = default_config()
    cfg.actor_rollout_ref.rollout.multi_turn.reward_to = "every"
    with pytest.raises(ConfigError, match="every"):
        EpisodeRewardConfig.from_config(cfg)
    assert EpisodeRewardConfig.from_config(default_config()) == EpisodeRewardConfig("all", 0.9)


# --------------------------------------------------------------------------------------------------
# through the worker: rm_scores / reward_valid rows
# --------------------------------------------------------------------------------------------------
class ThreeSnapshots(AgentLoopBase):
    """Three trajectories; the loop scores the final one 1.0 (e.g. an interaction's
    calculate_score), or leaves the scoring to the reward function (``final_score`` None)."""

    final_score: float | None = 1.0

    async def run(self, sampling_params, **kwargs):
        ids = self.tokenizer.apply_chat_template(kwargs["raw_prompt"], add_generation_prompt=True)
        outs = []
        for j in range(3):
            o = await self.server_manager.generate(
                request_id=f"{kwargs['uid']}-{j}", prompt_ids=ids, sampling_params=sampling_params
            )
            outs.append(AgentLoopOutput(prompt_ids=ids, response_ids=o.token_ids,
                                        response_mask=[1] * len(o.token_ids),
                                        reward_score=self.final_score if j == 2 else None))
        return outs


class ThreeUnscored(ThreeSnapshots):
    final_score = None


def run_worker(
    reward_to: str, reward: dict[str, Any] | None = None, loop: type = ThreeSnapshots
) -> DataProto:
    cfg = default_config()
    cfg.data.max_prompt_length = 64
    cfg.data.max_response_length = 16
    cfg.actor_rollout_ref.rollout.multi_turn.reward_to = reward_to
    cfg.actor_rollout_ref.rollout.multi_turn.reward_gamma = 0.5
    if reward:
        cfg.custom_reward_function = OmegaConf.merge(cfg.custom_reward_function, reward)
    OmegaConf.resolve(cfg)
    registry = resolve_registry()
    registry["three"] = ResolvedAgentLoop(name="three", cls=loop)
    server = ScriptedServer(
        lambda ids, params, rid: [*TOK.encode("The answer is 4."), IM_END], eos_token_id=IM_END
    )
    worker = AgentLoopWorker.from_slices(
        cfg.actor_rollout_ref.rollout, OmegaConf.create({"path": "unused"}), [server],
        registry=registry, tokenizer=TOK, trainer_config=cfg,
    )
    prompts = np.empty(2, dtype=object)
    prompts[:] = [[{"role": "user", "content": f"q{i}"}] for i in range(2)]
    nt = {"raw_prompt": prompts, "uid": np.array(["a", "b"], dtype=object), "index": np.arange(2),
          "agent_name": np.array(["three"] * 2, dtype=object),
          "reward_model": np.array([{"ground_truth": "4"}] * 2, dtype=object)}
    return asyncio.run(
        worker.generate_sequences(DataProto(batch=None, non_tensor_batch=nt, meta_info={}))
    )


@pytest.mark.parametrize(("mode", "expected"), [("all", [1.0, 1.0, 1.0]), ("last", [0.0, 0.0, 1.0]),
                                                ("discounted", [0.25, 0.5, 1.0])])
def test_worker_rows_follow_multi_turn_reward_to(mode, expected):
    out = run_worker(mode)
    assert out.batch["rm_scores"].sum(-1).tolist() == expected * 2
    assert out.batch["reward_valid"].tolist() == [1] * 6
    assert out.non_tensor_batch["trajectory_index"].tolist() == [0, 1, 2] * 2


def test_worker_with_a_custom_function_calls_it_once_per_episode():
    out = run_worker(
        "last", {"path": "test_reward_to", "name": "episode_score"}, loop=ThreeUnscored
    )
    assert out.batch["rm_scores"].sum(-1).tolist() == [0.0, 0.0, 4.0] * 2
    assert len(CALLS) == 2  # one per sample, not one per trajectory
    assert out.non_tensor_batch["acc"].tolist() == [1.0] * 6


def test_an_episode_the_loop_scored_keeps_its_score_over_the_function():
    """verl's rule: the worker calls the reward function only for a trajectory without a score of
    its own."""
    out = run_worker("last", {"path": "test_reward_to", "name": "episode_score"})
    assert out.batch["rm_scores"].sum(-1).tolist() == [0.0, 0.0, 1.0] * 2 and CALLS == []


def test_worker_start_rejects_a_bad_reward_to():
    with pytest.raises(ConfigError, match="reward_to"):
        run_worker("sometimes")


# --------------------------------------------------------------------------------------------------
# gateway sessions: compaction branches are one episode, by the same rule
# --------------------------------------------------------------------------------------------------
async def compacting_agent(
    *, base_url: str, api_key: str, raw_prompt: list, **fields: Any
) -> float:
    """Two branches in order: a first conversation, then a compacted one that starts from a
    summary."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "pick a word"}]
    )
    summary = [
        {
            "role": "user",
            "content": "Summary: you picked a word. Pick one more word, a longer word.",
        }
    ]
    await client.chat.completions.create(model="m", messages=summary)
    return 0.5


@pytest.fixture(scope="module")
def gateway_runner():
    from agentloop.gateway.framework import register_agent_runner
    from agentloop.loops.base import _agent_loop_registry

    register_agent_runner("compacting")(compacting_agent)
    yield
    _agent_loop_registry.pop("compacting", None)


def run_gateway(multi_turn_reward_to: str, **gateway: Any) -> DataProto:
    from gateway_helpers import FakePolicy
    from transformers import AutoTokenizer

    from agentloop.gateway.actor import GatewayActor
    from agentloop.testing.tiny_model import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
    cfg = default_config()
    cfg.data.max_prompt_length = 400
    cfg.data.max_response_length = 200
    OmegaConf.resolve(cfg)
    r = cfg.actor_rollout_ref.rollout
    r.multi_turn.reward_to, r.multi_turn.reward_gamma = multi_turn_reward_to, 0.5
    for k, v in gateway.items():
        OmegaConf.update(r, f"gateway.{k}", v)
    prompts = np.empty(1, dtype=object)
    prompts[:] = [[{"role": "user", "content": "pick a word"}]]
    nt = {"raw_prompt": prompts, "uid": np.array(["s"], dtype=object), "index": np.arange(1),
          "agent_name": np.array(["compacting"], dtype=object)}

    async def go() -> DataProto:
        server = ScriptedServer(FakePolicy(tokenizer), eos_token_id=tokenizer.eos_token_id)
        gw = GatewayActor.from_slices(
            r, OmegaConf.create({"path": "tiny"}), [server], tokenizer=tokenizer
        )
        await gw.start()
        try:
            worker = AgentLoopWorker.from_slices(
                r, OmegaConf.create({"path": "tiny"}), [server], registry=resolve_registry(),
                tokenizer=tokenizer, gateways=[gw], trainer_config=cfg,
            )
            return await worker.generate_sequences(
                DataProto(batch=None, non_tensor_batch=nt, meta_info={})
            )
        finally:
            await gw.shutdown()

    return asyncio.run(go())


@pytest.mark.usefixtures("gateway_runner")
def test_gateway_branches_are_one_episode_with_the_same_rule():
    out = run_gateway("last", reward_to=None)  # gateway.reward_to null: follow multi_turn.reward_to
    nt = out.non_tensor_batch
    assert nt["trajectory_index"].tolist() == [0, 1] and nt["num_trajectories"].tolist() == [2, 2]
    # the gateway session is the episode
    assert nt["session_id"].tolist() == nt["gateway_session_id"].tolist()
    assert nt["session_id"][0] == nt["session_id"][1]
    assert out.batch["rm_scores"].sum(-1).tolist() == [0.0, 0.5]
    # the gateway's own key wins, gamma from multi_turn
    out = run_gateway("all", reward_to="discounted")
    assert out.batch["rm_scores"].sum(-1).tolist() == [0.25, 0.5]
    out = run_gateway("all", reward_to="longest")
    scores = out.batch["rm_scores"].sum(-1).tolist()
    lengths = out.batch["attention_mask"][:, -200:].sum(-1).tolist()
    assert scores[int(np.argmax(lengths))] == 0.5 and sorted(scores) == [0.0, 0.5]
