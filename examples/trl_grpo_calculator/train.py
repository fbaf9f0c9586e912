"""TRL's GRPOTrainer with agentloop as its rollout backend, on the calculator task (CPU, minutes).

    .venv/bin/python examples/trl_grpo_calculator/train.py [--seed 0] [--steps 60] [--lr 1e-4]
    .venv/bin/python examples/trl_grpo_calculator/train.py --backend trl   # TRL's own tool loop

1. Loads the weak starting checkpoint (``ensure_tiny_model(snapshot_step=400)``) as TRL's policy
   and starts an :class:`agentloop.AgentLoopManager` on it (``tool_agent`` + the calculator tool,
   the task and config of ``examples/grpo_calculator``, imported from there).
2. Greedy evaluation on held-out problems through the manager.
3. ``GRPOTrainer(..., rollout_func=rollout, callbacks=[rollout])`` with
   ``rollout = agentloop.integrations.trl.AgentLoopRollout(manager)``: every rollout is agentloop's
   multi-turn tool loop on vLLM; after every optimizer step the callback streams the policy's
   weights into the engine; the reward is agentloop's (``agentloop_reward``).
4. Greedy evaluation again.

``--backend trl``: no agentloop in the training loop; TRL generates with the policy itself
(``transformers`` ``generate``) and runs its own tool loop (``tools=[calculator]``). The
evaluations still run on agentloop's engine, synced with the final weights.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "grpo_calculator"))

from grpo import greedy_success, load_policy, problem_rows, rollout_config  # noqa: E402

from agentloop.rewards.calculator import compute_score  # noqa: E402
from agentloop.tools.calculator import evaluate, format_number  # noqa: E402

STEP_KEYS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
             "clip_ratio/region_mean", "tools/call_frequency")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line (defaults: the measured runs of README.md)."""
    p = argparse.ArgumentParser(description="TRL GRPOTrainer + agentloop on the calculator task")
    p.add_argument("--backend", choices=("agentloop", "trl"), default="agentloop")
    p.add_argument("--steps", type=int, default=60, help="rollouts (generation batches)")
    p.add_argument("--prompts", type=int, default=16, help="problems per rollout")
    p.add_argument("--n", type=int, default=8, help="samples per problem (num_generations)")
    p.add_argument("--updates", type=int, default=2, help="optimizer steps per rollout")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--eval-problems", type=int, default=256)
    p.add_argument("--seed", type=int, default=0,
                   help="training problems and order, torch, TRL, vLLM sampling")
    p.add_argument("--eval-seed", type=int, default=1000,
                   help="held-out problems (the same set for every --seed)")
    p.add_argument("--eval-at", type=int, nargs="*", default=[],
                   help="also evaluate (greedy, held-out) after these rollouts")
    p.add_argument("--out", default="outputs/trl_grpo_calculator")
    return p.parse_args(argv)


def grpo_args(a: argparse.Namespace, out: Path) -> Any:
    """TRL's GRPOConfig: ``prompts × n`` samples per generation, ``updates`` optimizer steps on
    them (PPO-clip ε 0.2, no KL, constant lr, fp32 on CPU)."""
    from trl import GRPOConfig  # optional dependency (the trl extra)

    batch = a.prompts * a.n
    micro = batch // (a.updates * 2)
    return GRPOConfig(
        output_dir=str(out / "trainer"), max_steps=a.steps * a.updates, learning_rate=a.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        per_device_train_batch_size=micro, gradient_accumulation_steps=2,
        steps_per_generation=a.updates * 2, num_generations=a.n, max_completion_length=128,
        temperature=1.0, beta=0.0, epsilon=0.2, use_cpu=True, bf16=False, seed=a.seed,
        data_seed=a.seed, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0,
    )


def calculator(expression: str):  # no return annotation: the schema the model was trained on
    """Evaluate an arithmetic expression with integers and the operators +, - and *.

    Args:
        expression: The expression, e.g. 12 * 7
    """
    return format_number(evaluate(expression))


class PrintSteps:
    """Prints TRL's per-rollout logs (the keys of STEP_KEYS) and keeps them."""

    def __init__(self, updates: int) -> None:
        self.updates = updates
        self.history: list[dict[str, float]] = []
        self.evals: dict[int, float] = {}
        self.t0 = time.perf_counter()

    def __call__(self, logs: dict[str, float], step: int) -> None:
        if "reward" not in logs:  # only the first optimizer step of a rollout logs its reward
            return
        rollout = (step - 1) // self.updates + 1
        record = {"rollout": rollout, "step": step, "seconds": time.perf_counter() - self.t0,
                  **{k: logs[k] for k in STEP_KEYS if k in logs}}
        self.history.append(record)
        shown = "  ".join(f"{k.split('/')[-1]} {v:.3f}" for k, v in record.items()
                          if k not in ("rollout", "step", "seconds"))
        print(f"rollout {rollout:3d}  {shown}  t {record['seconds']:.0f}s", flush=True)


def make_trainer(a: argparse.Namespace, model_path: Path, manager: Any, out: Path,
                 printer: PrintSteps, held_out: list[dict[str, Any]]) -> tuple[Any, Any]:
    """The GRPOTrainer of ``--backend`` and the AgentLoopRollout (None for ``trl``)."""
    from datasets import Dataset  # optional dependencies (the trl extra)
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from agentloop.integrations.trl import AgentLoopRollout, agentloop_reward

    class Logs(TrainerCallback):  # type: ignore[misc]
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
                   **kwargs: Any) -> None:
            printer(logs or {}, state.global_step)

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None,
                        **kwargs: Any) -> None:
            done, rest = divmod(state.global_step, a.updates)
            if rest or done not in a.eval_at:
                return
            if a.backend == "trl":  # agentloop's callback (listed first) synced it already
                manager.update_weights(model.state_dict())
            success = greedy_success(manager, held_out)
            printer.evals[done] = success
            print(f"greedy success at rollout {done}: {success:.3f}", flush=True)

    rows = problem_rows(a.steps * a.prompts, seed=a.seed)
    data = Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    policy = load_policy(model_path)
    if a.backend == "agentloop":
        rollout = AgentLoopRollout(manager)
        trainer = GRPOTrainer(model=policy, args=grpo_args(a, out), train_dataset=data,
                              processing_class=tokenizer, reward_funcs=[agentloop_reward],
                              rollout_func=rollout, callbacks=[rollout, Logs()])
    else:
        rollout = None
        # the tiny model's template is Qwen2.5's hermes format, which TRL does not recognise by
        # text: give the tokenizer TRL's parser for that format
        tokenizer.response_template = qwen3_template
        trainer = GRPOTrainer(model=policy, args=grpo_args(a, out), train_dataset=data,
                              processing_class=tokenizer, reward_funcs=[answer_reward],
                              tools=[calculator], callbacks=[Logs()])
    trainer.remove_callback(PrinterCallback)  # the Logs callback prints a shorter line
    return trainer, rollout


def answer_reward(completions: list[Any], reward_model: list[dict[str, Any]],
                  **kwargs: Any) -> list[float]:
    """The calculator task's reward on TRL's decoded completions (``--backend trl``): agentloop's
    ``compute_score`` on the text of the completion's messages."""
    rewards = []
    for messages, truth in zip(completions, reward_model, strict=True):
        text = "\n".join(str(m.get("content") or "") for m in messages)
        rewards.append(float(compute_score("calculator", text, truth["ground_truth"])))
    return rewards


def run(a: argparse.Namespace) -> dict[str, Any]:
    """The whole experiment; returns what ``metrics.json`` holds."""
    import ray
    import torch

    from agentloop import AgentLoopManager
    from agentloop.testing.tiny_model import SNAPSHOT_STEP, ensure_tiny_model

    out = Path(a.out) / f"{a.backend}-seed{a.seed}"
    model_path = ensure_tiny_model(snapshot_step=SNAPSHOT_STEP)
    torch.manual_seed(a.seed)
    print(f"seed: {a.seed}  eval seed: {a.eval_seed}  backend: {a.backend}", flush=True)
    ray.init(include_dashboard=False, logging_level=logging.ERROR)
    manager = AgentLoopManager(rollout_config(model_path, temperature=1.0, seed=a.seed))
    try:
        held_out = problem_rows(a.eval_problems, seed=a.eval_seed)
        before = greedy_success(manager, held_out)
        print(f"greedy success before: {before:.3f} ({a.eval_problems} held-out problems)",
              flush=True)
        printer = PrintSteps(a.updates)
        trainer, rollout = make_trainer(a, model_path, manager, out, printer, held_out)
        t0 = time.perf_counter()
        trainer.train()
        train_seconds = time.perf_counter() - t0
        if rollout is None:  # TRL's own generation: the engine gets the final weights once
            manager.update_weights(trainer.model.state_dict())
        after = greedy_success(manager, held_out)
        print(f"greedy success after: {after:.3f} ({after - before:+.3f}); {a.steps} rollouts "
              f"in {train_seconds:.0f}s ({train_seconds / a.steps:.1f}s each); seed {a.seed}",
              flush=True)
    finally:
        manager.shutdown()
        ray.shutdown()
    result = {"args": vars(a), "greedy_before": before, "greedy_after": after,
              "train_seconds": train_seconds, "history": printer.history,
              "greedy_at": printer.evals}
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out / 'metrics.json'}")
    return result


def main(argv: list[str] | None = None) -> None:
    """Parse arguments and run (environment defaults as in the Makefile)."""
    for key, value in {
        "RAY_AUTH_MODE": "disabled", "VLLM_CPU_KVCACHE_SPACE": "1", "RAY_DEDUP_LOGS": "1",
        "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1",
    }.items():
        os.environ.setdefault(key, value)
    run(parse_args(argv))


if __name__ == "__main__":
    main()
