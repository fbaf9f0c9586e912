"""GRPO on the calculator task: an HF policy trained from agentloop rollouts on vLLM (CPU).

    .venv/bin/python examples/grpo_calculator/train.py [--steps 60] [--prompts 16] [--n 8] [--lr
    1e-4] [--seed 0] [--async]

1. Builds (first time only, ~2-4 min) and loads the weak starting checkpoint: the tiny model's
   training run stopped at step 400 of 1100 (``ensure_tiny_model(snapshot_step=400)``).
2. Starts an :class:`agentloop.AgentLoopManager` (``cpu_train`` preset, ``tool_agent`` + calculator
   tool) and loads the same checkpoint as the HF ``Qwen2ForCausalLM`` policy.
3. Greedy evaluation on held-out problems.
4. Each step: ``prompts`` new problems × ``n`` samples
   (:func:`agentloop.batch.data.repeat_for_rollout`) → ``manager.generate_sequences`` → rewards →
   group advantages → PPO-clip updates → ``manager.update_weights(policy.state_dict())``.
5. Greedy evaluation again; writes ``outputs/grpo_calculator/{metrics.json, reward_curve.png}``.

``--async``: the rollout runs ahead of training (:class:`agentloop.rollout.rollouter.Rollouter`, one
step of data in flight beyond the step being trained, ``max_staleness`` 1 weight version): each step
takes the first ``prompts`` complete groups, trains on them while the engine keeps generating, then
syncs the weights.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from grpo import (  # noqa: E402 - the example's own module, next to this file
    GRPOConfig,
    greedy_success,
    group_advantages,
    group_rows,
    load_policy,
    make_batch,
    problem_rows,
    rollout_config,
    sequence_rewards,
    train_on_rollout,
)


def parse_args(argv: list[str] | None = None) -> tuple[GRPOConfig, Path]:
    """Command line → (hyper-parameters, output directory)."""
    d = GRPOConfig()
    parser = argparse.ArgumentParser(
        description="GRPO on the calculator task with agentloop rollouts."
    )
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--prompts", type=int, default=d.prompts_per_step, help="problems per step")
    parser.add_argument("--n", type=int, default=d.n, help="samples per problem (the GRPO group)")
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument(
        "--mini-batches", type=int, default=d.mini_batches, help="optimizer steps per rollout"
    )
    parser.add_argument("--eval-problems", type=int, default=d.eval_problems)
    parser.add_argument("--seed", type=int, default=d.seed,
                        help="training problems and order, torch, vLLM sampling")
    parser.add_argument("--eval-seed", type=int, default=d.eval_seed, help="held-out problems")
    parser.add_argument("--out", default="outputs/grpo_calculator")
    parser.add_argument("--async", dest="async_rollout", action="store_true",
                        help="generate ahead of training with the Rollouter (max_staleness 1)")
    a = parser.parse_args(argv)
    cfg = GRPOConfig(
        steps=a.steps, prompts_per_step=a.prompts, n=a.n, lr=a.lr, mini_batches=a.mini_batches,
        eval_problems=a.eval_problems, seed=a.seed, eval_seed=a.eval_seed,
        async_rollout=a.async_rollout,
    )
    return cfg, Path(a.out)


def plot_curve(history: list[dict[str, float]], before: float, after: float, path: Path) -> None:
    """Sampled reward per step, with the greedy evaluation before and after, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, rewards = [h["step"] for h in history], [h["reward"] for h in history]
    window = 5
    smooth = [
        sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
        for i in range(len(rewards))
    ]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(steps, rewards, marker="o", ms=3, alpha=0.45, label="sampled reward (T=1), per step")
    ax.plot(steps, smooth, color="C0", lw=2, label=f"sampled reward, mean of last {window} steps")
    ax.scatter(
        [0, steps[-1] + 1], [before, after], color="C3", zorder=3, label="greedy, held-out problems"
    )
    ax.annotate(f"{before:.2f}", (0, before), textcoords="offset points", xytext=(6, -12))
    ax.annotate(f"{after:.2f}", (steps[-1] + 1, after), textcoords="offset points", xytext=(-28, 6))
    ax.set(
        xlabel="GRPO step", ylabel="success rate", ylim=(0, 1),
        title="GRPO on the calculator task (tiny model)",
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg: GRPOConfig, out_dir: Path) -> dict[str, Any]:
    """The whole experiment; returns what ``metrics.json`` holds."""
    import ray
    import torch

    from agentloop import AgentLoopManager
    from agentloop.testing.tiny_model import SNAPSHOT_STEP, ensure_tiny_model

    model_path = ensure_tiny_model(snapshot_step=SNAPSHOT_STEP)
    seed_everything(cfg.seed)
    print(f"seed {cfg.seed} (training problems and their order, torch, vLLM sampling)", flush=True)
    ray.init(include_dashboard=False, logging_level=logging.ERROR)
    manager = AgentLoopManager(
        rollout_config(model_path, temperature=cfg.temperature, seed=cfg.seed)
    )
    try:
        policy = load_policy(model_path)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)
        held_out = problem_rows(cfg.eval_problems, seed=cfg.eval_seed)
        train_rows = problem_rows(cfg.steps * cfg.prompts_per_step, seed=cfg.seed)
        before = greedy_success(manager, held_out)
        print(
            f"greedy success before: {before:.3f} ({cfg.eval_problems} held-out problems)",
            flush=True,
        )
        history, t_start = [], time.perf_counter()
        step_rows = [train_rows[(s - 1) * cfg.prompts_per_step: s * cfg.prompts_per_step]
                     for s in range(1, cfg.steps + 1)]
        rollouter = None
        if cfg.async_rollout:
            from agentloop.rollout.rollouter import Rollouter

            # one step of samples generating while the previous step trains; at most one step
            # finished and waiting
            rollouter = Rollouter(
                manager, (make_batch(rows, cfg.n) for rows in step_rows),
                max_inflight=cfg.prompts_per_step * cfg.n, max_queue=cfg.prompts_per_step,
                max_staleness=1, groups_per_dispatch=2,
            ).start()
        for step in range(1, cfg.steps + 1):
            history.append(
                grpo_step(manager, policy, optimizer, cfg, step, step_rows[step - 1], rollouter)
            )
        if rollouter is not None:
            rollouter.stop()
        train_seconds = time.perf_counter() - t_start
        after = greedy_success(manager, held_out)
        print(f"greedy success after:  {after:.3f} (+{after - before:.3f}); {cfg.steps} steps in "
              f"{train_seconds:.0f}s", flush=True)
    finally:
        manager.shutdown()
        ray.shutdown()
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "config": asdict(cfg), "model": str(model_path), "greedy_before": before,
        "greedy_after": after, "train_seconds": train_seconds, "history": history,
    }
    (out_dir / "metrics.json").write_text(json.dumps(result, indent=2) + "\n")
    plot_curve(history, before, after, out_dir / "reward_curve.png")
    print(f"wrote {out_dir / 'metrics.json'} and {out_dir / 'reward_curve.png'}")
    return result


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, numpy and torch (the policy's init is loaded, but dropout-free
    training still draws nothing else; vLLM gets the seed through the rollout config)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def grpo_step(manager: Any, policy: Any, optimizer: Any, cfg: GRPOConfig, step: int,
              rows: list[dict[str, Any]], rollouter: Any = None) -> dict[str, float]:
    """One rollout → update → weight sync round; prints and returns its metrics.  With a
    ``rollouter`` the step's data are the next ``prompts_per_step`` groups it finished (generated
    while the last step trained)."""
    t0 = time.perf_counter()
    out = (rollouter.get(num_groups=cfg.prompts_per_step) if rollouter is not None
           else manager.generate_sequences(make_batch(rows, cfg.n)))
    t1 = time.perf_counter()
    rewards, valid = sequence_rewards(out, manager.tokenizer)
    advantages = group_advantages(rewards, out.non_tensor_batch["uid"], valid)
    stats = train_on_rollout(policy, optimizer, out, advantages, cfg)
    t2 = time.perf_counter()
    if stats["updates"]:
        manager.update_weights(policy.state_dict())
    t3 = time.perf_counter()
    groups = group_rows(out.non_tensor_batch["uid"])
    mixed = sum(bool(advantages[g].ne(0).any()) for g in groups) / len(groups)
    record = {
        "step": step, "reward": float(rewards.mean()), "invalid": int((~valid).sum()),
        "mixed_groups": mixed, **stats, "rollout_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2,
    }
    print(
        f"step {step:3d}  reward {record['reward']:.3f}  mixed groups {mixed:.2f}  loss "
        f"{stats['loss']:+.4f}  "
        f"clipfrac {stats['clipfrac']:.3f}  |dlogp| "
        f"{stats['logprob_gap_mean']:.0e}/{stats['logprob_gap_max']:.0e}  "
        f"rollout {t1 - t0:.1f}s  train {t2 - t1:.1f}s  sync {t3 - t2:.2f}s",
        flush=True,
    )
    return record


def main(argv: list[str] | None = None) -> None:
    """Parse arguments and run (environment defaults as in the Makefile)."""
    for key, value in {
        "RAY_AUTH_MODE": "disabled", "VLLM_CPU_KVCACHE_SPACE": "1", "RAY_DEDUP_LOGS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }.items():
        os.environ.setdefault(key, value)
    cfg, out_dir = parse_args(argv)
    run(cfg, out_dir)


if __name__ == "__main__":
    main()
