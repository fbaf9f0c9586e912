"""reasoning-gym against the real package (offline): rows reproducible by seed, the reward equal to
the dataset's own score_answer (directly, through the worker's custom_reward_function and through
env_agent on the scripted engine)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import pytest
from omegaconf import OmegaConf

from agentloop.batch.data import load_dataset, read_rows
from agentloop.config import EnvConfig, default_config
from agentloop.envs import ENVS, resolve_env
from agentloop.envs import reasoning_gym as rg
from agentloop.errors import ConfigError
from agentloop.loops.env_agent import EnvAgentLoop
from agentloop.rewards import load_reward_function
from agentloop.rollout.worker import AgentLoopWorker
from agentloop.routing import AsyncLLMServerManager
from agentloop.testing import FakeTokenizer, ScriptedServer
from agentloop.testing.fake_tokenizer import IM_END

reasoning_gym = pytest.importorskip("reasoning_gym")

TOK = FakeTokenizer()
TASKS = ["leg_counting", "basic_arithmetic", "word_sorting", "word_ladder", "arc_1d"]
"""A few task kinds: numbers, text lists, a generator that depends on the hash seed
(word_ladder), grids (arc_1d)."""


def own_entry(dataset: str, seed: int, size: int, index: int) -> tuple[Any, dict[str, Any]]:
    data = reasoning_gym.create_dataset(dataset, size=size, seed=seed)
    return data, data[index]


def answers(truth: str) -> list[str]:
    """Response texts: right, right with spaces, wrong, partial, no answer tag."""
    return [f"<answer>{truth}</answer>", f"think...\n<answer> {truth} </answer>",
            "<answer>0</answer>", f"<answer>{truth} or so</answer>", f"just {truth}"]


def rollout_cfg(**root: Any) -> Any:
    cfg = default_config()
    cfg.data.max_prompt_length = 2048
    cfg.data.max_response_length = 64
    for key, value in root.items():
        OmegaConf.update(cfg, key, value)
    OmegaConf.resolve(cfg)
    return cfg


def test_same_seed_same_rows_other_seed_other_rows():
    first = rg.make_rows("leg_counting", 4, seed=3)
    rg._dataset.cache_clear()
    assert rg.make_rows("leg_counting", 4, seed=3) == first
    assert rg.make_rows("leg_counting", 4, seed=4) != first
    row = first[1]
    assert row["data_source"] == "reasoning_gym/leg_counting"
    assert row["prompt"][0] == {"role": "system",
                                "content": reasoning_gym.utils.SYSTEM_PROMPTS["default"]}
    data, entry = own_entry("leg_counting", 3, 4, 1)
    assert row["prompt"][1] == {"role": "user", "content": entry["question"]}
    assert row["reward_model"]["ground_truth"] == entry["answer"]
    assert row["extra_info"]["index"] == 1
    assert rg.make_rows("leg_counting", 1, 3, system=None)[0]["prompt"][0]["role"] == "user"


def test_the_command_line_writes_the_same_rows_in_another_process(tmp_path):
    path = tmp_path / "rows.jsonl"
    subprocess.run([sys.executable, "-m", "agentloop.envs.reasoning_gym", "basic_arithmetic",
                    "--size", "5", "--seed", "11", "--config", '{"min_terms": 2, "max_terms": 3}',
                    "--row-fields", '{"agent_name": "single_turn_agent"}', "-o", str(path)],
                   check=True, capture_output=True, timeout=120)
    rows = read_rows(path)
    expected = rg.make_rows("basic_arithmetic", 5, 11, {"min_terms": 2, "max_terms": 3},
                            row_fields={"agent_name": "single_turn_agent"})
    assert rows == expected and rows[0]["agent_name"] == "single_turn_agent"


@pytest.mark.parametrize("task", TASKS)
def test_compute_score_equals_score_answer(task):
    for row in rg.make_rows(task, 3, seed=5):
        recipe = row["extra_info"]["reasoning_gym"]
        data, entry = own_entry(task, 5, 3, recipe["index"])
        truth = row["reward_model"]["ground_truth"]
        for text in answers(truth):
            expected = data.score_answer(reasoning_gym.utils.extract_answer(text), entry)
            got = rg.compute_score(row["data_source"], text, truth, row["extra_info"])
            assert got == expected, (task, text)
        assert rg.compute_score(row["data_source"], answers(truth)[0], truth,
                                row["extra_info"]) == data.score_answer(truth, entry)


def test_whole_response_as_the_answer_and_parquet_rows(tmp_path):
    path = rg.write_rows(tmp_path / "rows.parquet", rg.make_rows("leg_counting", 3, 2))
    for row in read_rows(path):
        data, entry = own_entry("leg_counting", 2, 3, row["extra_info"]["index"])
        truth = row["reward_model"]["ground_truth"]
        assert rg.compute_score(None, truth, truth, row["extra_info"], answer_tag=None) == \
            data.score_answer(truth, entry) == 1.0


def test_the_rows_stored_entry_wins_when_regeneration_differs():
    """A generator that depends on the hash seed regenerates another entry in another process:
    the row's stored entry is scored (simulated by editing the stored entry)."""
    row = rg.make_rows("leg_counting", 2, 9)[0]
    recipe = row["extra_info"]["reasoning_gym"]
    stored = json.loads(recipe["entry"])
    stored["answer"] = "12345"
    recipe["entry"] = json.dumps(stored, sort_keys=True)
    assert rg.compute_score(None, "<answer>12345</answer>", "12345", row["extra_info"]) == 1.0
    with pytest.raises(ValueError, match="differs from the row's ground_truth"):
        rg.compute_score(None, "<answer>1</answer>", "7", row["extra_info"])


def test_bad_rows_and_names_are_refused():
    with pytest.raises(ValueError, match="no extra_info.reasoning_gym"):
        rg.compute_score(None, "x", "1", {"index": 0})
    with pytest.raises(ValueError, match="must hold dataset, seed, size and index"):
        rg.compute_score(None, "x", "1", {"reasoning_gym": {"dataset": "leg_counting"}})
    with pytest.raises(ConfigError, match="did you mean 'leg_counting'"):
        rg.make_rows("leg_countin", 2, 0)
    with pytest.raises(ConfigError, match="refused its config"):
        rg.make_rows("leg_counting", 2, 0, {"no_such_field": 1})


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym raises
    with pytest.raises(ConfigError, match=r"pip install 'agentloop\[envs\]'"):
        rg.ReasoningGymEnv.check_config({})


def reply_by_question(rows: list[dict[str, Any]], texts: list[str]) -> Any:
    """A ScriptedServer script answering each row's question with its text."""
    questions = [row["prompt"][-1]["content"] for row in rows]
    by_question = dict(zip(questions, texts, strict=True))

    def script(prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str) -> list:
        prompt = TOK.decode(prompt_ids)
        (text,) = [t for q, t in by_question.items() if q in prompt]
        return TOK.encode(text) + [IM_END]

    return script


def test_as_custom_reward_function_through_the_worker(tmp_path):
    rows = rg.make_rows("basic_arithmetic", 4, seed=1)
    texts = [answers(r["reward_model"]["ground_truth"])[i] for i, r in enumerate(rows)]
    path = rg.write_rows(tmp_path / "rows.jsonl", rows)
    assert load_reward_function("agentloop.envs.reasoning_gym") is rg.compute_score
    cfg = rollout_cfg(**{"custom_reward_function.path": "agentloop.envs.reasoning_gym"})
    worker = AgentLoopWorker.from_slices(
        cfg.actor_rollout_ref.rollout, OmegaConf.create({"path": "unused"}),
        [ScriptedServer(reply_by_question(rows, texts), eos_token_id=IM_END)], tokenizer=TOK,
        trainer_config=cfg,
    )
    out = asyncio.run(worker.generate_sequences(load_dataset(path)))
    scores = out.batch["rm_scores"].sum(-1).tolist()
    expected = []
    for row, text in zip(rows, texts, strict=True):
        data, entry = own_entry("basic_arithmetic", 1, 4, row["extra_info"]["index"])
        expected.append(data.score_answer(reasoning_gym.utils.extract_answer(text), entry))
    assert scores == pytest.approx(expected) and expected[0] == 1.0 and 0.0 in expected


def test_as_an_environment_through_env_agent():
    assert ENVS["reasoning_gym"] is rg.ReasoningGymEnv
    cfg = rollout_cfg()
    rollout = cfg.actor_rollout_ref.rollout
    resolve_env("reasoning_gym", EnvConfig.from_rollout(rollout))
    row = rg.make_rows("leg_counting", 1, seed=8, row_fields={
        "agent_name": "env_agent", "extra_info": {"env": "reasoning_gym"}})[0]
    truth = row["reward_model"]["ground_truth"]
    text = f"I count.\n<answer>{truth}</answer>"
    server = ScriptedServer([TOK.encode(text) + [IM_END]], eos_token_id=IM_END)

    async def go() -> Any:
        EnvAgentLoop.init_class(rollout, TOK)
        loop = EnvAgentLoop(rollout, AsyncLLMServerManager([server]), TOK)
        fields = {k: v for k, v in row.items() if k != "prompt"}
        return await loop.run({}, raw_prompt=row["prompt"], **fields)

    out = asyncio.run(go())
    data, entry = own_entry("leg_counting", 8, 1, 0)
    assert out.status == "stop" and out.reward_score == data.score_answer(truth, entry) == 1.0
    assert out.extra_fields["turn_scores"] == [1.0]
    assert out.extra_fields["env_info"] == {"rg_dataset": "leg_counting"}
    assert TOK.decode(out.prompt_ids) == TOK.decode(TOK.apply_chat_template(
        row["prompt"], add_generation_prompt=True))
