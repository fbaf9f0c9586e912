"""The shipped environment examples (examples/environments/*.yaml) on vLLM CPU with the tiny model.

Each config is loaded as ``agentloop rollout --config`` loads it (``build_config`` with only the
model path and ``data.max_samples`` added, then ``load_dataset``) and rolled out by an
``AgentLoopManager`` of its own; all of them share ONE vLLM server (conftest's
``shared_tiny_engine``, also test_vllm_context_window's), handed to each as ``llm_client`` (verl's
shared-server form). Checked per
environment: the tool / observation turns are the chat template's render (``agentloop verify``'s
template check), rewards equal the package's own scorer on the same text, statuses, and self-play's
two trajectories per game. One more test, last (the shared server is stopped by then), runs the
real CLI in a subprocess (its own engine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agentloop.batch.data import load_dataset
from agentloop.cli.rollout import build_config
from agentloop.config import resolve_config
from agentloop.envs.skyrl import skyrl_extras
from agentloop.loops.prompt import apply_chat_template
from agentloop.report.verify import VerifyResult, check_templates
from agentloop.rewards.calculator import compute_score as calculator_score
from agentloop.routing import AsyncLLMServerManager

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "environments"
SAMPLES = 2
"""Rows taken from each example's dataset (``data.max_samples``)."""
MAX_MODEL_LEN = 2560
"""The shared server's context: the largest example's prompt + response (self-play: 512 + 2048)."""
STATUSES = {"stop", "length", "max_turns"}
# eager: ~10 s less per CPU engine start (compiled, the default: the CLI test below)
EAGER = "actor_rollout_ref.rollout.enforce_eager=true"


@pytest.fixture(scope="module")
def model_path() -> str:
    from agentloop.testing.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model())


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def example_config(name: str, model_path: str, *extra: str) -> Any:
    """``examples/environments/<name>.yaml`` as ``agentloop rollout --config`` builds it."""
    overrides = [f"actor_rollout_ref.model.path={model_path}", f"data.max_samples={SAMPLES}",
                 f"actor_rollout_ref.rollout.max_model_len={MAX_MODEL_LEN}",
                 "actor_rollout_ref.rollout.calculate_log_probs=true", EAGER, *extra]
    return build_config(str(EXAMPLES / f"{name}.yaml"), overrides)


@pytest.fixture(scope="module")
def rollout(model_path: str, shared_tiny_engine: list[Any]) -> Any:
    """``rollout(name)``: the example's first rows rolled out, as (DataProto, dataset rows), each
    example by a manager of its own over ONE vLLM server (conftest's, shared with
    test_vllm_context_window)."""
    from agentloop.rollout.manager import AgentLoopManager

    cwd = os.getcwd()
    os.chdir(REPO)  # the examples name their files relative to the repository

    def run(name: str) -> tuple[Any, list[dict[str, Any]]]:
        cfg = example_config(name, model_path)
        resolved = resolve_config(cfg)
        batch = load_dataset(str(resolved.data.train_files), prompt_key=resolved.data.prompt_key,
                             n=1, max_samples=SAMPLES)
        manager = AgentLoopManager(cfg, llm_client=AsyncLLMServerManager(shared_tiny_engine))
        try:
            out = manager.generate_sequences(batch)
        finally:
            manager.shutdown()
        lines = Path(resolved.data.train_files).read_text().splitlines()
        return out, [json.loads(line) for line in lines[:SAMPLES]]

    yield run
    os.chdir(cwd)


def unpadded(out: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per row: (response ids, response mask) without padding."""
    b = out.batch
    p_len = b["prompts"].shape[1]
    keep = b["attention_mask"].numpy().astype(bool)[:, p_len:]
    return [(b["responses"][i].numpy()[keep[i]], b["response_mask"][i].numpy()[keep[i]])
            for i in range(len(out))]


def turns(tokenizer: Any, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """The decoded text of each sampled turn (mask-1 run), as the loops hand it on."""
    texts, run = [], []
    for t, m in [*zip(ids.tolist(), mask.tolist(), strict=True), (None, 0)]:
        if m:
            run.append(t)
        elif run:
            texts.append(tokenizer.decode(run, skip_special_tokens=True))
            run = []
    return texts


def rewards(out: Any) -> list[float | None]:
    b = out.batch
    if "rm_scores" not in b:  # no row has a reward
        return [None] * len(out)
    valid = b["reward_valid"].numpy() if "reward_valid" in b else np.ones(len(out))
    scores = b["rm_scores"].float().sum(-1).numpy()
    return [float(s) if v else None for s, v in zip(scores, valid, strict=True)]


def assert_template_exact(tokenizer: Any, out: Any, prompts: bool = True) -> None:
    """``agentloop verify``'s template check: every row saved its conversation and each tool /
    observation turn is the template's render; with ``prompts`` also each row's prompt ids are the
    template's render of the conversation's messages before the first assistant turn."""
    result = VerifyResult()
    check_templates(tokenizer, out, result)
    moved = [i for i, (ids, _) in enumerate(unpadded(out)) if len(ids)]  # (a seat may never move)
    assert result.template_rows == len(moved), "every row saved its conversation"
    assert not result.template_problems, result.template_problems
    if prompts:
        for i in moved:
            messages = out.non_tensor_batch["messages"][i]
            first = next(k for k, m in enumerate(messages) if m["role"] == "assistant")
            assert_prompt(tokenizer, out, i, messages[:first])


def assert_prompt(tokenizer: Any, out: Any, row: int, messages: list[dict[str, Any]]) -> None:
    """Row ``row``'s prompt ids are the template's render of ``messages`` (generation prompt)."""
    b = out.batch
    p_len = b["prompts"].shape[1]
    ids = b["prompts"][row].numpy()[b["attention_mask"][row].numpy().astype(bool)[:p_len]]
    expected = apply_chat_template(tokenizer, list(messages), add_generation_prompt=True)
    assert ids.tolist() == expected


def test_skyrl_gym(rollout: Any, tokenizer: Any) -> None:
    skyrl_gym = pytest.importorskip("skyrl_gym")
    out, rows = rollout("skyrl_gym")
    nt = out.non_tensor_batch
    assert list(nt["env"]) == ["skyrl_gym"] * SAMPLES
    assert set(nt["status"].tolist()) <= STATUSES
    assert_template_exact(tokenizer, out)
    for i, ((ids, mask), row) in enumerate(zip(unpadded(out), rows, strict=True)):
        own = skyrl_gym.make(row["env_class"], env_config={}, extras=skyrl_extras(row))
        own.init(row["prompt"])
        texts = turns(tokenizer, ids, mask)
        expected = [float(own.step(text)["reward"] or 0.0) for text in texts]
        assert list(nt["turn_scores"][i]) == pytest.approx(expected)
        assert rewards(out)[i] == pytest.approx(sum(expected))


def test_reasoning_gym(rollout: Any, tokenizer: Any) -> None:
    reasoning_gym = pytest.importorskip("reasoning_gym")
    extract_answer = reasoning_gym.utils.extract_answer
    out, rows = rollout("reasoning_gym")
    assert set(out.non_tensor_batch["status"].tolist()) <= {"stop", "length"}
    for i, ((ids, _), row) in enumerate(zip(unpadded(out), rows, strict=True)):
        assert_prompt(tokenizer, out, i, row["prompt"])  # single turn: no conversation saved
        recipe = row["extra_info"]["reasoning_gym"]
        data = reasoning_gym.create_dataset(recipe["dataset"], size=recipe["size"],
                                            seed=recipe["seed"], **json.loads(recipe["config"]))
        text = tokenizer.decode(ids.tolist(), skip_special_tokens=True)
        expected = data.score_answer(extract_answer(text), data[recipe["index"]])
        assert rewards(out)[i] == pytest.approx(float(expected))


def replay(env_id: str, seed: int, num_players: int, moves: dict[int, list[str]]) -> Any:
    """The same moves played on textarena directly, each player's in order when it is to move;
    the game's rewards, or None when the moves ran out before the game ended."""
    import textarena as ta

    game = ta.make(env_id)
    game.reset(num_players=num_players, seed=seed)
    left = {p: list(m) for p, m in moves.items()}
    while True:
        player, _ = game.get_observation()
        if not left.get(player):
            return None
        if game.step(left[player].pop(0))[0]:
            return game.close()[0]


def test_textarena_single_player(rollout: Any, tokenizer: Any) -> None:
    pytest.importorskip("textarena")
    out, rows = rollout("textarena")
    nt = out.non_tensor_batch
    assert list(nt["env"]) == ["textarena"] * SAMPLES
    assert set(nt["status"].tolist()) <= STATUSES
    assert_template_exact(tokenizer, out)
    for i, ((ids, mask), row) in enumerate(zip(unpadded(out), rows, strict=True)):
        spec = row["extra_info"]["env"]
        game = replay(spec["env_id"], spec["seed"], 1, {0: turns(tokenizer, ids, mask)})
        if nt["status"][i] == "stop":  # the game ended: its own reward for player 0
            assert game is not None and rewards(out)[i] == pytest.approx(float(game[0]))


def test_textarena_selfplay(rollout: Any, tokenizer: Any) -> None:
    pytest.importorskip("textarena")
    out, rows = rollout("textarena_selfplay")
    nt = out.non_tensor_batch
    assert len(out) == 2 * SAMPLES and list(nt["env"]) == ["textarena"] * (2 * SAMPLES)
    assert set(nt["status"].tolist()) <= STATUSES
    assert_template_exact(tokenizer, out)
    sessions: dict[str, dict[int, int]] = {}
    for i, session in enumerate(nt["session_id"].tolist()):
        sessions.setdefault(session, {})[int(nt["trajectory_index"][i])] = i
    assert len(sessions) == SAMPLES and all(sorted(s) == [0, 1] for s in sessions.values())
    seqs = unpadded(out)
    for game_no, seats in enumerate(sessions.values()):  # games in sample order
        spec = rows[game_no]["extra_info"]["env"]
        assert [nt["player_id"][seats[p]] for p in (0, 1)] == [0, 1]
        moves = {p: turns(tokenizer, *seqs[seats[p]]) for p in (0, 1)}
        if nt["game_done"][seats[0]]:  # each player's reward is the game's own for that player
            game = replay(spec["env_id"], spec["seed"], 2, moves)
            assert game is not None
            assert [rewards(out)[seats[p]] for p in (0, 1)] == [float(game[0]), float(game[1])]
        else:
            assert [rewards(out)[seats[p]] for p in (0, 1)] == [None, None]


def test_mcp(rollout: Any, tokenizer: Any) -> None:
    pytest.importorskip("mcp")
    out, rows = rollout("mcp")
    nt = out.non_tensor_batch
    assert set(nt["status"].tolist()) <= STATUSES and "env" not in nt
    assert_template_exact(tokenizer, out, prompts=False)  # (the prompt shows the MCP tool)
    for i, ((ids, _), row) in enumerate(zip(unpadded(out), rows, strict=True)):
        text = tokenizer.decode(ids.tolist(), skip_special_tokens=True)
        expected = calculator_score(row["data_source"], text,
                                    row["reward_model"]["ground_truth"], row["extra_info"])
        assert rewards(out)[i] == pytest.approx(float(expected))


def test_cli_rollout_of_the_skyrl_gym_example(
    model_path: str, tmp_path: Path, shared_engine_stopped: None
) -> None:
    """The real command line, one engine: summary.json's reward_by_env and trajectories.jsonl."""
    out_dir = tmp_path / "skyrl"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "agentloop"), "rollout", "--config",
         "examples/environments/skyrl_gym.yaml", f"actor_rollout_ref.model.path={model_path}",
         f"output_dir={out_dir}", "data.max_samples=4"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=420,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["num_trajectories"] == 4 and summary["failed_rows"] == 0
    by_env = summary["reward_by_env"]
    assert list(by_env) == ["skyrl_gym"] and by_env["skyrl_gym"]["rows_scored"] == 4
    assert by_env["skyrl_gym"]["mean"] == pytest.approx(summary["reward"]["mean"])
    lines = [json.loads(line) for line in (out_dir / "trajectories.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(line["status"] in STATUSES for line in lines)
