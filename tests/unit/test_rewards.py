"""Rewards: verl's custom reward function called by the worker, the scoring rule, built-in scorers,
and rm_scores / reward_valid surviving failed samples across workers."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf

from agentloop.batch.metrics import align_keys, performance_metrics
from agentloop.batch.protocol import DataProto, split_rows
from agentloop.config import default_config
from agentloop.errors import ConfigError
from agentloop.loops.base import AgentLoopBase, ResolvedAgentLoop, resolve_registry
from agentloop.rewards import (
    RewardFunctionConfig,
    TrajectoryScorer,
    calculator,
    gsm8k,
    load_reward_function,
    parse_result,
)
from agentloop.rollout.worker import AgentLoopWorker
from agentloop.testing import ScriptedServer
from agentloop.testing.fake_tokenizer import IM_END, FakeTokenizer
from agentloop.types import AgentLoopOutput, RolloutStatus

TOK = FakeTokenizer()
CALLS: list[dict[str, Any]] = []


# --------------------------------------------------------------------------------------------------
# scorers referenced by module path from the config (``test_rewards:<name>``)
# --------------------------------------------------------------------------------------------------
def recording_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    CALLS.append(
        {
            "data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth,
            "extra_info": extra_info, "kwargs": kwargs, "thread": threading.current_thread().name,
        }
    )
    return {"score": float(ground_truth == "4"), "pred": solution_str[-2:]}


async def async_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    await asyncio.sleep(0)
    CALLS.append({"thread": threading.current_thread().name})
    return 0.5


def raising_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if "question 1" in str(extra_info.get("q")):
        raise RuntimeError("judge unavailable")
    return 1.0


def slow_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    time.sleep(0.5)
    return 1.0


async def slow_async_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    await asyncio.sleep(5)
    return 1.0


def bad_return(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return {"acc": 1.0}


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------
def answer(ids, params, rid):
    """'The answer is 4.' unless the prompt says fail (then the engine raises: the sample fails)."""
    if "fail" in TOK.decode(ids):
        raise RuntimeError("engine exploded")
    return [*TOK.encode("The answer is 4."), IM_END]


def make_worker(
    reward: dict[str, Any] | None = None, script=answer, registry=None
) -> AgentLoopWorker:
    cfg = default_config()
    cfg.data.max_prompt_length = 64
    cfg.data.max_response_length = 32
    if reward is not None:
        cfg.custom_reward_function = OmegaConf.merge(cfg.custom_reward_function, reward)
    OmegaConf.resolve(cfg)
    return AgentLoopWorker.from_slices(
        cfg.actor_rollout_ref.rollout, OmegaConf.create({"path": "unused"}),
        [ScriptedServer(script, eos_token_id=IM_END)], registry=registry, tokenizer=TOK,
        trainer_config=cfg,
    )


def make_batch(
    texts: list[str], truths: list[str] | None = None, agent: str | None = None
) -> DataProto:
    n = len(texts)
    col = lambda values: np.array(values, dtype=object)  # noqa: E731
    prompts = np.empty(n, dtype=object)
    prompts[:] = [[{"role": "user", "content": t}] for t in texts]
    nt = {"raw_prompt": prompts, "uid": col([f"u{i}" for i in range(n)]), "index": np.arange(n),
          "data_source": col(["calc"] * n),
          "reward_model": col([{"ground_truth": t} for t in (truths or ["4"] * n)]),
          "extra_info": col([{"index": i, "q": t} for i, t in enumerate(texts)])}
    if agent:
        nt["agent_name"] = col([agent] * n)
    return DataProto(batch=None, non_tensor_batch=nt, meta_info={})


def run(coro):
    return asyncio.run(coro)


def scores(out: DataProto) -> list[float]:
    return out.batch["rm_scores"].sum(-1).tolist()


class ScoredLoop(AgentLoopBase):
    """Sets its own reward_score (1.0) and two tool step rewards."""

    async def run(self, sampling_params, **kwargs):
        ids = self.tokenizer.apply_chat_template(kwargs["raw_prompt"], add_generation_prompt=True)
        o = await self.server_manager.generate(request_id=kwargs["uid"], prompt_ids=ids,
                                               sampling_params=sampling_params)
        return AgentLoopOutput(
            prompt_ids=ids, response_ids=o.token_ids, response_mask=[1] * len(o.token_ids),
            reward_score=1.0, num_turns=2, extra_fields={"tool_rewards": [0.5, 0.25]},
        )


def scored_registry() -> dict[str, ResolvedAgentLoop]:
    registry = resolve_registry()
    registry["scored"] = ResolvedAgentLoop(name="scored", cls=ScoredLoop)
    return registry


@pytest.fixture(autouse=True)
def _clear_calls():
    CALLS.clear()


# --------------------------------------------------------------------------------------------------
# the worker calls verl's compute_score
# --------------------------------------------------------------------------------------------------
def test_custom_reward_function_gets_verls_arguments_and_a_dict_result_becomes_columns(tmp_path):
    scorer_file = tmp_path / "my_reward.py"
    scorer_file.write_text("from test_rewards import recording_score as compute_score\n")
    worker = make_worker({"path": str(scorer_file), "reward_kwargs": {"bonus": 2}})
    out = run(
        worker.generate_sequences(make_batch(["question 0", "question 1"], truths=["4", "5"]))
    )
    assert scores(out) == [1.0, 0.0] and out.batch["reward_valid"].tolist() == [1, 1]
    call = sorted(CALLS, key=lambda c: c["extra_info"]["index"])[0]
    assert (
        call["data_source"] == "calc"
        and call["ground_truth"] == "4"
        and call["kwargs"] == {"bonus": 2}
    )
    assert call["solution_str"] == "The answer is 4."  # special tokens skipped
    assert call["extra_info"]["q"] == "question 0" and call["extra_info"]["num_turns"] == 2
    assert call["extra_info"]["rollout_reward_scores"] == {}
    # a plain function never runs on the event loop
    assert call["thread"].startswith("agentloop-reward")
    assert out.meta_info["reward_extra_keys"] == ["score", "pred"]
    assert out.non_tensor_batch["pred"].tolist() == ["4.", "4."]
    assert all(m["compute_score"] > 0 for m in out.meta_info["metrics"])
    assert out.non_tensor_batch["reward_error"].tolist() == [None, None]


def test_module_path_forms_and_async_scorer():
    worker = make_worker({"path": "test_rewards", "name": "async_score"})
    assert worker.rewards.is_async
    out = run(worker.generate_sequences(make_batch(["a", "b"])))
    assert scores(out) == [0.5, 0.5] and CALLS[0]["thread"] == threading.current_thread().name
    assert out.meta_info["reward_extra_keys"] == ["acc"]  # verl's record of a float result
    assert load_reward_function("pkg://test_rewards", "slow_score") is slow_score
    assert load_reward_function("test_rewards:bad_return") is bad_return


def test_builtin_scorer_by_module_name_and_truncated_response():
    worker = make_worker({"path": "agentloop.rewards.calculator"})
    out = run(worker.generate_sequences(make_batch(["a", "b"], truths=["4", "7"])))
    assert scores(out) == [1.0, 0.0]
    long = make_worker({"path": "test_rewards", "name": "recording_score"},
                       script=lambda ids, p, rid: TOK.encode("x" * 40 + "The answer is 4."))
    run(long.generate_sequences(make_batch(["a"])))
    # the response the trainer sees: its first response_length ids
    assert CALLS[0]["solution_str"] == "x" * 32


def test_raising_scorer_marks_only_its_row():
    worker = make_worker({"path": "test_rewards", "name": "raising_score"})
    out = run(worker.generate_sequences(make_batch(["question 0", "question 1", "question 2"])))
    assert scores(out) == [1.0, 0.0, 1.0] and out.batch["reward_valid"].tolist() == [1, 0, 1]
    assert out.non_tensor_batch["status"].tolist() == ["stop"] * 3  # the rollout itself succeeded
    err = out.non_tensor_batch["reward_error"][1]
    assert "raising_score raised RuntimeError: judge unavailable" in err
    assert performance_metrics(out, 1.0)["agent_loop/reward/num_invalid"] == 1.0


@pytest.mark.parametrize("name", ["slow_score", "slow_async_score"])
def test_slow_scorer_times_out_into_reward_error(name):
    worker = make_worker({"path": "test_rewards", "name": name, "timeout": 0.05})
    t0 = time.perf_counter()
    out = run(worker.generate_sequences(make_batch(["a", "b"])))
    assert time.perf_counter() - t0 < 2.0
    assert out.batch["reward_valid"].tolist() == [0, 0] and scores(out) == [0.0, 0.0]
    assert "timeout=0.05s" in out.non_tensor_batch["reward_error"][0]
    assert out.non_tensor_batch["status"].tolist() == ["stop", "stop"]


def test_malformed_result_is_an_error_not_a_score():
    assert parse_result({"acc": 1.0})[2] is not None and "'score'" in str(
        parse_result({"acc": 1.0})[2]
    )
    assert parse_result("high")[0] is None and parse_result(float("nan"))[0] is None
    assert parse_result(np.float32(0.5)) == (0.5, {"acc": 0.5}, None)
    assert parse_result(True)[0] == 1.0
    worker = make_worker({"path": "test_rewards", "name": "bad_return"})
    out = run(worker.generate_sequences(make_batch(["a"])))
    assert out.batch["reward_valid"].tolist() == [0]


def test_bad_path_fails_the_worker_start(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        make_worker({"path": str(tmp_path / "missing.py")})
    with pytest.raises(ConfigError, match="cannot import module 'no_such_pkg.scorer'"):
        make_worker({"path": "no_such_pkg.scorer"})
    with pytest.raises(ConfigError, match="'nope' not found"):
        make_worker({"path": "agentloop.rewards.gsm8k", "name": "nope"})
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('missing dependency')\n")
    with pytest.raises(ConfigError, match="missing dependency"):
        make_worker({"path": str(broken)})
    with pytest.raises(ConfigError, match="timeout"):
        make_worker({"path": "agentloop.rewards.gsm8k", "timeout": "soon"})


def test_config_block_follows_verl():
    assert RewardFunctionConfig.from_config(default_config()) == RewardFunctionConfig()
    # verl's trainer config: name null
    verl_top = {"custom_reward_function": {"path": "m.py", "name": None}}
    assert RewardFunctionConfig.from_config(verl_top).name == "compute_score"
    nested = {"custom_reward_function": {"path": None, "timeout": 5},
              # verl 0.9's place
              "reward": {"custom_reward_function": {"path": "pkg.mod", "name": "score_fn"}}}
    got = RewardFunctionConfig.from_config(nested)
    assert (got.path, got.name, got.timeout) == ("pkg.mod", "score_fn", 5.0)
    assert (
        RewardFunctionConfig.from_config({"custom_reward_function": {"timeout": 0}}).timeout is None
    )


def test_unfinished_rollouts_are_not_scored_and_loop_scores_win_as_in_verl():
    worker = make_worker(
        {"path": "test_rewards", "name": "recording_score"}, registry=scored_registry()
    )
    out = run(
        worker.generate_sequences(make_batch(["fail", "ok"], truths=["4", "5"], agent="scored"))
    )
    # verl's rule: the loop's own 1.0 wins and the function is not called for it; the failed sample
    # has no
    # reward even though its loop would have set one (a function is configured: unfinished rows are
    # not scored)
    assert scores(out) == [0.0, 1.0] and out.batch["reward_valid"].tolist() == [0, 1]
    assert CALLS == [] and "status 'error'" in out.non_tensor_batch["reward_error"][0]


# --------------------------------------------------------------------------------------------------
# the rule with tool rewards (TrajectoryScorer directly)
# --------------------------------------------------------------------------------------------------
def _score(config: RewardFunctionConfig, *outputs: AgentLoopOutput) -> list[float | None]:
    run(
        TrajectoryScorer(config, TOK, 16).score(
            list(outputs), {"reward_model": {"ground_truth": "4"}}
        )
    )
    return [o.reward_score for o in outputs]


def _out(score: float | None = None, tools: Any = (), status=RolloutStatus.STOP) -> AgentLoopOutput:
    ids = TOK.encode("The answer is 4.")
    return AgentLoopOutput(
        prompt_ids=[5], response_ids=ids, response_mask=[1] * len(ids), reward_score=score,
        status=status, extra_fields={"tool_rewards": list(tools)},
    )


def test_add_tool_rewards_rule():
    plain = RewardFunctionConfig()
    add = RewardFunctionConfig(add_tool_rewards=True)
    with_fn = RewardFunctionConfig(path="agentloop.rewards.calculator", add_tool_rewards=True)
    assert _score(plain, _out(1.0, [0.5])) == [1.0]  # off: the loop's score as it is
    assert _score(add, _out(1.0, [0.5, 0.25])) == [1.75]  # on: added to the loop's score
    # no outcome source: the sum alone
    assert _score(add, _out(None, [0.5, 0.25]), _out(None)) == [0.75, 0.0]
    # a failed rollout earns nothing
    assert _score(add, _out(None, [1.0], status=RolloutStatus.ERROR)) == [None]
    assert _score(with_fn, _out(None, [0.5])) == [1.5]  # function score (1.0) + tools
    # the loop's own score wins over the function (verl), + tools
    assert _score(with_fn, _out(0.0, [0.5])) == [0.5]
    bad = _out(1.0, ["x"])
    assert _score(add, bad) == [None] and "tool_rewards" in bad.extra_fields["reward_error"]
    assert (
        TrajectoryScorer(plain, TOK).configured is False and TrajectoryScorer(add, TOK).configured
    )


# --------------------------------------------------------------------------------------------------
# built-in scorers
# --------------------------------------------------------------------------------------------------
def test_calculator_scorer():
    assert calculator.compute_score("calc", "7*6 = 42.\nThe answer is 42.", "42") == 1.0
    assert (
        calculator.compute_score("calc", "The answer is 41. No, the answer is 1,042.", "1042")
        == 1.0
    )
    assert calculator.compute_score("calc", "The answer is -3.", "-3.0") == 1.0
    assert calculator.compute_score("calc", "42", "42") == 0.0  # no statement
    assert calculator.compute_score("calc", "The answer is 41.", "42", extra_info={}) == 0.0
    with pytest.raises(ValueError, match="no ground truth"):
        calculator.compute_score("calc", "The answer is 4.", None)


def test_gsm8k_scorer():
    solution = "Natalia sold 48/2 = 24 clips in May.\n#### 72"
    assert gsm8k.compute_score("openai/gsm8k", "48 + 24 = 72 clips.\n#### 72", solution) == 1.0
    assert gsm8k.compute_score("openai/gsm8k", "#### 1,234.0", "1234") == 1.0
    assert gsm8k.compute_score("openai/gsm8k", "so 72 clips", "72") == 1.0  # flexible: last number
    # flexible prefers the marker
    assert gsm8k.compute_score("openai/gsm8k", "#### 72 then 5", "72") == 1.0
    assert gsm8k.compute_score("openai/gsm8k", "so 72 clips", "72", method="strict") == 0.0
    assert gsm8k.compute_score("openai/gsm8k", "#### -5", "-5", method="strict") == 1.0
    assert gsm8k.compute_score("openai/gsm8k", "#### 70", "72", format_score=0.1) == 0.1
    assert gsm8k.compute_score("openai/gsm8k", "no number", "72", format_score=0.1) == 0.0
    with pytest.raises(ValueError, match="method"):
        gsm8k.compute_score("openai/gsm8k", "#### 72", "72", method="fuzzy")
    with pytest.raises(ValueError, match="contains no number"):
        gsm8k.compute_score("openai/gsm8k", "#### 72", "seventy-two")


def test_gateway_reward_function_still_imports():
    from agentloop.utils.imports import import_object

    fn = import_object("agentloop.rewards:final_answer_match", "test")
    assert (
        fn(
            [{"role": "assistant", "content": "The answer is 72."}],
            reward_model={"ground_truth": "72"},
        )
        == 1.0
    )
    assert (
        fn([{"role": "assistant", "content": "The answer is 7."}], extra_info={"answer": "#### 72"})
        == 0.0
    )


# --------------------------------------------------------------------------------------------------
# rm_scores survive failed samples, over one or several workers
# --------------------------------------------------------------------------------------------------
def test_two_workers_one_failed_sample_keeps_the_neighbours_score():
    """The reported bug: worker A's failed sample used to zero its correct neighbour (or drop
    rm_scores)."""
    batch = make_batch(["fail", "question 1", "question 2", "question 3"])
    chunks = split_rows(batch, 2)
    reward = {"path": "agentloop.rewards.calculator"}
    parts = [run(make_worker(reward).generate_sequences(c)) for c in chunks]
    out = DataProto.concat(align_keys(parts))
    assert out.non_tensor_batch["status"].tolist() == ["error", "stop", "stop", "stop"]
    assert scores(out) == [0.0, 1.0, 1.0, 1.0] and out.batch["reward_valid"].tolist() == [
        0, 1, 1, 1,
    ]


def test_loop_scores_one_worker_with_a_failed_row_keeps_rm_scores():
    # no custom function: the loop's own reward_score
    worker = make_worker(registry=scored_registry())
    out = run(worker.generate_sequences(make_batch(["fail", "ok"], agent="scored")))
    assert DataProto.concat(align_keys([out])).batch["rm_scores"].sum(-1).tolist() == [0.0, 1.0]
    assert out.batch["reward_valid"].tolist() == [0, 1]


def test_a_worker_whose_rows_all_failed_gets_invalid_reward_rows():
    registry = scored_registry()
    good = run(
        make_worker(registry=registry).generate_sequences(make_batch(["ok", "ok"], agent="scored"))
    )
    failed = run(
        make_worker(registry=registry).generate_sequences(
            make_batch(["fail", "fail"], agent="scored")
        )
    )
    assert "rm_scores" not in set(failed.batch.keys())  # no row had a reward source
    out = DataProto.concat(align_keys([failed, good]))
    assert scores(out) == [0.0, 0.0, 1.0, 1.0] and out.batch["reward_valid"].tolist() == [
        0, 0, 1, 1,
    ]
    assert "status 'error'" in out.non_tensor_batch["reward_error"][0]
    assert out.non_tensor_batch["reward_error"][2] is None
