"""TRL 1.16's GRPOTrainer with agentloop as its rollout backend, 3 steps on the vLLM CPU engine.

``AgentLoopRollout`` is the trainer's ``rollout_func`` (tool_agent, calculator task, 4 problems × 4
samples per step) and its callback streams the policy into the engine after every optimizer step.
After training, the engine must serve the trainer's weights: the log-probs it returns for the
tokens it samples equal an HF fp32 forward of ``trainer.model`` (same tolerances as
test_grpo_smoke.py: mean 2e-6, max 1e-3), while the starting weights are measurably further away.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

pytestmark = pytest.mark.integration
pytest.importorskip("trl")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_calculator"
MEAN_TOLERANCE = 2e-6
MAX_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def grpo() -> Any:
    sys.path.insert(0, str(EXAMPLE))
    try:
        import grpo as module
    finally:
        sys.path.remove(str(EXAMPLE))
    return module


def engine_gaps(grpo: Any, manager: Any, policies: list[Any], rows: list[Any]
                ) -> list[tuple[float, float]]:
    """(mean, max) |engine - HF| log-prob over the sampled tokens of one fresh rollout, per
    policy."""
    out = manager.generate_sequences(grpo.make_batch(rows, 2))
    mask = out.batch["response_mask"].bool()
    gaps = []
    for policy in policies:
        with torch.no_grad():
            logp = grpo.response_log_probs(policy, out.batch)
        diff = (logp - out.batch["rollout_log_probs"]).abs()[mask]
        gaps.append((float(diff.mean()), float(diff.max())))
    return gaps


def test_three_grpo_trainer_steps_keep_the_engine_on_the_trainers_weights(grpo: Any,
                                                                          tmp_path: Path) -> None:
    import ray
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from agentloop import AgentLoopManager
    from agentloop.integrations.trl import AgentLoopRollout, agentloop_reward
    from agentloop.testing.tiny_model import SNAPSHOT_STEP, ensure_tiny_model

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    model_path = ensure_tiny_model(snapshot_step=SNAPSHOT_STEP)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    rollout_cfg = grpo.rollout_config(model_path, response_length=96)
    # eager: ~10 s less per CPU engine start (compiled, the default: test_vllm_envs CLI test)
    OmegaConf.update(rollout_cfg, "actor_rollout_ref.rollout.enforce_eager", True)
    manager = AgentLoopManager(rollout_cfg)
    try:
        rows = grpo.problem_rows(14, seed=7)
        rollout = AgentLoopRollout(manager)
        args = GRPOConfig(
            output_dir=str(tmp_path), max_steps=3, learning_rate=1e-4, num_generations=4,
            per_device_train_batch_size=16, gradient_accumulation_steps=1, beta=0.0,
            max_completion_length=96, use_cpu=True, bf16=False, seed=0, logging_steps=1,
            save_strategy="no", report_to="none", disable_tqdm=True, lr_scheduler_type="constant",
        )
        trainer = GRPOTrainer(
            model=grpo.load_policy(model_path), args=args,
            train_dataset=Dataset.from_list(rows[:12]),
            processing_class=AutoTokenizer.from_pretrained(str(model_path)),
            reward_funcs=[agentloop_reward], rollout_func=rollout, callbacks=[rollout],
        )
        trainer.train()
        assert rollout.samples == 3 * 16 and not rollout.failed
        assert rollout.syncs == 3 and rollout.last_synced_step == 3
        logged = [h for h in trainer.state.log_history if "reward" in h]
        assert len(logged) == 3 and all(0.0 <= h["reward"] <= 1.0 for h in logged)
        assert all(h["rewards/agentloop_reward/mean"] == h["reward"] for h in logged)
        trained = trainer.model.eval()
        original = grpo.load_policy(model_path).eval()
        (mean, worst), (old_mean, _) = engine_gaps(grpo, manager, [trained, original], rows[12:])
        assert mean < MEAN_TOLERANCE and worst < MAX_TOLERANCE, (mean, worst)
        assert old_mean > 5 * mean, (old_mean, mean)  # the weights moved; the engine has them
    finally:
        manager.shutdown()
        ray.shutdown()
