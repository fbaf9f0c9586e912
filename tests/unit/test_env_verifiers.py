"""verifiers environments through a gateway session (docs/environments.md#verifiers): the real
verifiers 0.4.0 in its own venv (``make verifiers-env``), the example environment
(examples/environments/verifiers_env.py), a scripted engine behind a real gateway."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import yaml
from omegaconf import OmegaConf

import agentloop.rollout.manager as manager_module
from agentloop.batch.protocol import DataProto
from agentloop.config import default_config
from agentloop.envs.verifiers import (
    DEFAULT_PYTHON,
    VerifiersAgentLoop,
    check_verifiers_entry,
)
from agentloop.errors import ConfigError
from agentloop.gateway.actor import GatewayActor
from agentloop.loops.base import ResolvedAgentLoop
from agentloop.rollout.worker import AgentLoopWorker
from agentloop.testing import ScriptedServer
from agentloop.testing.tiny_model import ensure_tiny_model

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / DEFAULT_PYTHON
EXAMPLES = ROOT / "examples" / "environments"
ENV = {"taskset": {"id": "verifiers_env", "num_tasks": 4, "seed": 0}}

pytestmark = pytest.mark.skipif(
    not PYTHON.exists(), reason="no verifiers venv: run `make verifiers-env`"
)


def policy(tokenizer: Any) -> Any:
    """Answers ``What is a + b?`` right when ``a`` is odd, one too high otherwise."""

    def reply(prompt_ids: list[int], params: dict[str, Any], request_id: str) -> list[int]:
        m = re.findall(r"What is (\d+) \+ (\d+)\?", tokenizer.decode(prompt_ids))
        a, b = (int(x) for x in m[-1]) if m else (0, 0)
        text = f"The sum is {a + b}." if a % 2 else f"It is {a + b + 1}."
        return list(tokenizer.encode(text, add_special_tokens=False)) + [tokenizer.eos_token_id]

    return reply


def rubric_scores(replies: list[str], answers: list[str]) -> list[float]:
    """The example's own rubric function, run in the verifiers venv on the same texts."""
    code = ("import json, sys; from verifiers_env import score_reply; "
            "print(json.dumps([score_reply(r, a) for r, a in json.load(sys.stdin)]))")
    pairs = json.dumps(list(zip(replies, answers, strict=True)))
    out = subprocess.run([str(PYTHON), "-c", code], input=pairs, capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": str(EXAMPLES)})
    return json.loads(out.stdout)


def batch(rows: list[dict[str, Any]]) -> DataProto:
    n = len(rows)
    nt: dict[str, Any] = {}
    for key in ("raw_prompt", "extra_info"):
        nt[key] = np.empty(n, dtype=object)
        nt[key][:] = [r[key] for r in rows]
    nt["agent_name"] = np.array([r.get("agent_name", "verifiers_sum") for r in rows], dtype=object)
    nt["uid"] = np.array([f"u{i}" for i in range(n)], dtype=object)
    nt["index"] = np.arange(n)
    return DataProto(batch=None, non_tensor_batch=nt, meta_info={})


async def run_rows(tokenizer: Any, rows: list[dict[str, Any]], env: dict[str, Any],
                   **more: dict[str, Any]) -> DataProto:
    """``rows`` through a worker whose loop ``verifiers_sum`` runs ``env`` (and one loop per
    ``more`` entry: name -> env) against a live gateway on the scripted engine."""
    r = OmegaConf.create({
        "prompt_length": 256, "response_length": 64, "calculate_log_probs": True,
        "multi_turn": {"format": "hermes"}, "gateway": {"host": "127.0.0.1"},
    })
    server = ScriptedServer(policy(tokenizer), eos_token_id=tokenizer.eos_token_id)
    gw = GatewayActor.from_slices(r, OmegaConf.create({"path": "tiny"}), [server],
                                  tokenizer=tokenizer)
    await gw.start()
    registry = {
        name: ResolvedAgentLoop(name, VerifiersAgentLoop,
                                {"env": e, "path": [str(EXAMPLES)], "python": str(PYTHON)})
        for name, e in {"verifiers_sum": env, **more}.items()
    }
    try:
        worker = AgentLoopWorker.from_slices(r, OmegaConf.create({"path": "tiny"}), [server],
                                             registry=registry, tokenizer=tokenizer, gateways=[gw])
        return await worker.generate_sequences(batch(rows))
    finally:
        await gw.shutdown()


def row_texts(out: DataProto, tokenizer: Any, i: int) -> tuple[list[int], list[int]]:
    mask = out.batch["attention_mask"][i].tolist()
    width = out.batch["prompts"].shape[1]
    prompt = [t for t, m in zip(out.batch["prompts"][i].tolist(), mask[:width], strict=True) if m]
    resp = [t for t, m in zip(out.batch["responses"][i].tolist(), mask[width:], strict=True) if m]
    return prompt, resp


def test_reward_is_the_rubric_score_and_the_tokens_are_the_sessions(tokenizer):
    lines = (EXAMPLES / "verifiers.jsonl").read_text().splitlines()
    questions = [json.loads(lines[i]) for i in (0, 3)]  # answered right, then wrong
    rows = [{"raw_prompt": q["prompt"], "extra_info": q["extra_info"]} for q in questions]
    # a task given as TaskData fields: the prompt is the row's
    rows.append({"raw_prompt": [{"role": "user", "content": "What is 3 + 4? Answer."}],
                 "extra_info": {"verifiers": {"task": {"answer": "7"}}}})
    # the example's harness with two replies: one trajectory, the follow-up user turn as context
    rows.append({**rows[0], "agent_name": "two_turns"})
    answers = [q["reward_model"]["ground_truth"] for q in questions] + ["7"]
    two_turns = {**ENV, "agent": {"harness": {"id": "verifiers_env", "max_turns": 2}}}
    out = asyncio.run(run_rows(tokenizer, rows, ENV, two_turns=two_turns))
    nt = out.non_tensor_batch
    assert nt["status"].tolist() == ["stop"] * 4, nt["error"].tolist()
    prompt, resp = row_texts(out, tokenizer, 3)
    first = tokenizer.encode("The sum is 74.", add_special_tokens=False)
    conversation = [*rows[0]["raw_prompt"], {"role": "assistant", "content": "The sum is 74."},
                    {"role": "user", "content": "Check it; give the number."},
                    {"role": "assistant", "content": "The sum is 74."}]
    whole = tokenizer.apply_chat_template(conversation, tokenize=True)
    assert prompt + resp == whole[: len(prompt + resp)]  # then only the template's closing newline
    assert tokenizer.decode(whole[len(prompt + resp):]).strip() == ""
    assert out.batch["response_mask"][3].sum().item() == 2 * (len(first) + 1)
    assert nt["__num_turns__"][3] == 4 and out.batch["rm_scores"][3].sum().item() == 1.0
    replies = []
    for i, row in enumerate(rows[:3]):
        prompt, resp = row_texts(out, tokenizer, i)
        # exact tokens: the task's prompt as the chat template renders it, then the sampled reply
        assert prompt == tokenizer.apply_chat_template(row["raw_prompt"], tokenize=True,
                                                       add_generation_prompt=True)
        assert resp[-1] == tokenizer.eos_token_id
        assert out.batch["response_mask"][i].sum().item() == len(resp)
        replies.append(tokenizer.decode(resp[:-1]))
    scores = rubric_scores(replies, answers)
    assert scores == [1.0, 0.0, 1.0]
    rewards = out.batch["rm_scores"].sum(-1).tolist()
    assert rewards[:3] == pytest.approx(scores)
    assert set(nt["env"].tolist()) == {"verifiers/verifiers_env"}


def test_an_error_in_the_environment_is_an_error_row_with_its_message(tokenizer, tmp_path):
    (tmp_path / "boom.py").write_text(
        "def boom(trace):\n    raise ValueError('the rubric exploded')\n"
    )
    env = {"taskset": {"id": "verifiers_env", "num_tasks": 2,
                       "task": {"rewards": {"boom": {"fn": f"{tmp_path}/boom.py:boom"}}}}}
    prompt = [{"role": "user", "content": "What is 1 + 2?"}]
    rows = [{"raw_prompt": prompt, "extra_info": {"verifiers": {"idx": 0}}},
            {"raw_prompt": prompt, "extra_info": {"verifiers": {"idx": 7}}}]
    out = asyncio.run(run_rows(tokenizer, rows, env))
    nt = out.non_tensor_batch
    assert nt["status"].tolist() == ["error", "error"]
    assert "the rubric exploded" in nt["error"][0]
    assert "verifiers environment 'verifiers_env'" in nt["error"][0]
    assert "taskset 'verifiers_env' has no task idx 7" in nt["error"][1]


def test_a_missing_venv_is_refused_before_any_engine_starts(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="make verifiers-env"):
        check_verifiers_entry({"env": ENV, "python": str(tmp_path / "nope" / "python")})
    with pytest.raises(ConfigError, match="needs a taskset id"):
        check_verifiers_entry({"env": {"taskset": {}}, "python": str(PYTHON)})
    check_verifiers_entry({"env": ENV, "python": str(PYTHON)})

    def no_servers(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("servers started")

    monkeypatch.setattr(manager_module, "open_servers", no_servers)
    loops = tmp_path / "loops.yaml"
    loops.write_text(yaml.safe_dump([{
        "name": "verifiers_sum", "_target_": "agentloop.envs.verifiers.VerifiersAgentLoop",
        "env": ENV, "python": str(tmp_path / "missing" / "python")}]))
    cfg = default_config()
    cfg.actor_rollout_ref.model.path = str(ensure_tiny_model())
    cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path = str(loops)
    was_up = ray.is_initialized()
    with pytest.raises(ConfigError, match=r"agent loop 'verifiers_sum': .*make verifiers-env"):
        manager_module.AgentLoopManager(cfg)
    assert ray.is_initialized() == was_up  # refused before Ray (and any engine)
