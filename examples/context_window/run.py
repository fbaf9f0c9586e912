"""Context-window example: the calculator agent with a sliding window of 1 turn and several
questions per episode.

    .venv/bin/python examples/context_window/run.py [--problems 8] [--n 4] [--window 1] [--questions
    3]

Run it from the repository root (the workers import ``examples.context_window.followups``).  Each
episode is one word problem followed by ``--questions - 1`` follow-up problems
(``FollowUpInteraction``); ``tool_agent`` keeps the system prompt, the first question and the last
``--window`` turns, so every follow-up pushes an older calculator result out of the window: the
trajectory so far is closed as a snapshot and a new one starts from the edited conversation. Prints,
per episode, its trajectories (rows), how each ended and its reward, then the GRPO advantages of
``agentloop.batch.grpo.group_advantages`` (each episode counted once in its group), and a JSON
summary; checks that every row is a full chat-template render of its own conversation.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def make_rows(count: int, questions: int, seed: int = 0) -> list[dict[str, Any]]:
    """Word problems (the tiny model's task), each with ``questions - 1`` follow-ups for the
    interaction."""
    from agentloop.testing.tiny_model import word_problem, word_problem_rows

    rows = word_problem_rows(
        count, agent_name="tool_agent", data_source="context_window", seed=seed
    )
    rng = random.Random(seed + 1)
    for row in rows:
        follow = [word_problem(rng) for _ in range(questions - 1)]
        row["extra_info"]["interaction_kwargs"] = {
            "name": "followups", "questions": [q for q, _, _ in follow],
            "answers": [row["reward_model"]["ground_truth"], *(str(a) for _, _, a in follow)],
        }
    return rows


def rollout_config(model_path: str, window: int, questions: int, greedy: bool = False) -> Any:
    """The calculator agent's settings plus the window, the follow-up interaction and the
    conversation per row."""
    from omegaconf import OmegaConf

    from agentloop.config import default_config

    cfg: Any = default_config()
    for key, value in {
        "actor_rollout_ref.model.path": model_path,
        "data.max_prompt_length": 1024,
        "data.max_response_length": 256,
        "actor_rollout_ref.rollout.temperature": 0.0 if greedy else 1.0,
        "actor_rollout_ref.rollout.dtype": "float32",
        "actor_rollout_ref.rollout.calculate_log_probs": True,
        "actor_rollout_ref.rollout.free_cache_engine": False,
        "actor_rollout_ref.rollout.max_num_seqs": 64,
        "actor_rollout_ref.rollout.agent.num_workers": 2,
        "actor_rollout_ref.rollout.agent.default_agent_loop": "tool_agent",
        "actor_rollout_ref.rollout.server.num_servers": 1,
        "actor_rollout_ref.rollout.server.device": "cpu",
        "actor_rollout_ref.rollout.multi_turn.enable": True,
        "actor_rollout_ref.rollout.multi_turn.format": "hermes",
        "actor_rollout_ref.rollout.multi_turn.tool_config_path": "examples/calculator_agent/tools.yaml",  # noqa: E501
        "actor_rollout_ref.rollout.multi_turn.interaction_config_path": str(
            HERE / "interactions.yaml"
        ),
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 3 * questions,
        "actor_rollout_ref.rollout.multi_turn.context_window": window,
        "actor_rollout_ref.rollout.multi_turn.return_messages": True,
    }.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def row_tokens(out: Any, i: int) -> list[int]:
    """Row ``i``'s prompt + response ids without padding."""
    b = out.batch
    attn = b["attention_mask"][i].bool()
    return b["input_ids"][i][attn].tolist()


def exact_rows(out: Any, tokenizer: Any, tools: list[dict[str, Any]] | None) -> tuple[int, int]:
    """How many rows equal a full chat-template render of their own conversation (``messages``): of
    all rows, and of the rows without a malformed tool call (whose parsed message cannot re-render
    the sampled text)."""
    from agentloop.loops.prompt import apply_chat_template
    from agentloop.tokenization.incremental import turn_separator

    sep = tokenizer.encode(turn_separator(tokenizer), add_special_tokens=False)
    good = clean = 0
    parse_errors = out.non_tensor_batch["num_parse_errors"].tolist()
    for i, messages in enumerate(out.non_tensor_batch["messages"].tolist()):
        full = apply_chat_template(tokenizer, list(messages), tools=tools)
        tail = sep if messages[-1]["role"] == "assistant" else []
        exact = row_tokens(out, i) + tail == full
        good += exact
        clean += exact and parse_errors[i] == 0
    return good, clean


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--problems", type=int, default=8)
    parser.add_argument("--n", type=int, default=4, help="episodes per problem (one GRPO group)")
    parser.add_argument("--window", type=int, default=1)
    parser.add_argument("--questions", type=int, default=3)
    args = parser.parse_args()

    import ray
    from transformers import AutoTokenizer

    from agentloop import AgentLoopManager
    from agentloop.batch.data import repeat_for_rollout, rows_to_batch
    from agentloop.batch.grpo import group_advantages
    from agentloop.testing.tiny_model import ensure_tiny_model
    from agentloop.tools.calculator import CALCULATOR_TOOL_DICT

    model = str(ensure_tiny_model())
    ray.init(include_dashboard=False, logging_level=logging.ERROR)
    manager = AgentLoopManager(rollout_config(model, args.window, args.questions))
    try:
        out = manager.generate_sequences(
            repeat_for_rollout(rows_to_batch(make_rows(args.problems, args.questions)), args.n)
        )
    finally:
        manager.shutdown()
        ray.shutdown()
    nt = out.non_tensor_batch
    scores = out.batch["rm_scores"].sum(-1).tolist()
    grouped = group_advantages(out, by="uid", episode_weight="last")
    episodes: dict[Any, list[int]] = defaultdict(list)
    for i, session in enumerate(nt["session_id"].tolist()):
        episodes[session].append(i)
    for session, rows in episodes.items():
        print(
            f"problem {nt['index'][rows[0]]} episode {str(session)[:8]}: {len(rows)} trajectories"
        )
        for i in rows:
            print(
                f"  [{nt['trajectory_index'][i]}] closed by {nt['context_edit'][i] or 'end':<8} "
                f"status {nt['status'][i]:<9} response "
                f"{int(out.batch['response_mask'][i].sum()):>3} sampled tokens"
                f"  reward {scores[i]:.2f}  advantage {float(grouped.advantages[i]):+.3f}  "
                f"weight {float(grouped.weights[i]):.2f}"
            )
    tokenizer = AutoTokenizer.from_pretrained(model)
    per_episode = [len(rows) for rows in episodes.values()]
    exact = exact_rows(out, tokenizer, [CALCULATOR_TOOL_DICT])
    summary = {
        "episodes": len(episodes),
        "rows": len(out),
        "trajectories_per_episode": sum(per_episode) / len(per_episode),
        "episodes_with_snapshots": sum(k > 1 for k in per_episode),
        "max_trajectories": max(per_episode),
        "rows_exact": exact[0],
        "rows_without_malformed_calls": sum(1 for e in nt["num_parse_errors"] if e == 0),
        "of_those_exact": exact[1],
        "mean_episode_reward": sum(scores[rows[-1]] for rows in episodes.values()) / len(episodes),
        "episode_weight_sums": sorted(
            {round(float(grouped.weights[rows].sum()), 6) for rows in episodes.values()}
        ),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
