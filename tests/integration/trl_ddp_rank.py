"""One rank of test_trl_multiprocess.py: TRL 1.16's GRPOTrainer under ``accelerate launch
--num_processes 2 --cpu`` (DDP, gloo) with ``AgentLoopRollout`` on this rank's own agentloop
manager (an in-process worker on a scripted engine: no Ray, no vLLM).

    torchrun --standalone --nproc_per_node 2 tests/integration/trl_ddp_rank.py OUT SYNC GROUP

(``accelerate launch --cpu`` starts several CPU processes only through mpirun; torchrun's
environment is what accelerate reads, and ``use_cpu`` makes the group gloo.) ``SYNC`` is
``AgentLoopRollout``'s ``sync_ranks`` (``all`` or ``main``), ``GROUP`` TRL's ``num_generations``
(4: each rank rolls out its own problem; 8: one group split between the ranks). Each rank writes
``OUT_DIR/rank<R>.json``: the prompts and uids its rollouts got, the weight updates its manager
received (step and a checksum of the weights), the trainer's final step and the checksum of its
final weights.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from agentloop.config import default_config
from agentloop.integrations.trl import AgentLoopRollout, agentloop_reward
from agentloop.rollout.worker import AgentLoopWorker
from agentloop.testing import ScriptedServer
from agentloop.testing.tiny_model import ensure_tiny_model

QUESTIONS = [f"what is {a} plus {a + 1}" for a in range(1, 9)]
"""Eight distinct problems; the answer of ``a plus a + 1`` is ``2a + 1``."""


def checksum(weights: dict[str, torch.Tensor]) -> float:
    """A float64 sum of every parameter's values (equal weights give equal sums)."""
    return float(sum(t.detach().double().sum().item() for t in weights.values()))


class RankManager:
    """The manager surface AgentLoopRollout uses, on an in-process worker and a scripted engine
    that answers right and wrong in turn (so that each group's rewards differ)."""

    def __init__(self, tokenizer: Any) -> None:
        cfg = default_config()
        cfg.data.max_prompt_length = 64
        cfg.data.max_response_length = 16
        cfg.actor_rollout_ref.rollout.calculate_log_probs = True
        cfg.custom_reward_function.path = "agentloop.rewards.calculator"
        cfg.custom_reward_function.name = "compute_score"
        OmegaConf.resolve(cfg)
        self.tokenizer = tokenizer
        self.calls = 0
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        server = ScriptedServer(self._reply, eos_token_id=end)
        self.worker = AgentLoopWorker.from_slices(
            cfg.actor_rollout_ref.rollout, OmegaConf.create({"path": "unused"}), [server],
            tokenizer=tokenizer, trainer_config=cfg)
        self.rollouts: list[dict[str, Any]] = []
        self.updates: list[dict[str, Any]] = []

    def _reply(self, ids: list[int], params: dict[str, Any], rid: str) -> list[int]:
        self.calls += 1
        text = self.tokenizer.decode(ids)
        a = next(a for a in range(8, 0, -1) if f"what is {a} plus" in text)
        answer = 2 * a + 1 + self.calls % 2  # right on even calls, wrong on odd ones
        return [*self.tokenizer.encode(f"The answer is {answer}.", add_special_tokens=False),
                self.tokenizer.convert_tokens_to_ids("<|im_end|>")]

    def generate_sequences(self, batch: Any) -> Any:
        """Roll out on the worker, recording which prompts and uids this rank got."""
        self.rollouts.append({
            "prompts": [m[-1]["content"] for m in batch.non_tensor_batch["raw_prompt"]],
            "uids": [str(u) for u in batch.non_tensor_batch["uid"]],
        })
        return asyncio.run(self.worker.generate_sequences(batch))

    def update_weights(self, weights: Any, *, global_steps: int | None = None) -> int:
        """Record the update (its step and the weights' checksum)."""
        self.updates.append({"step": global_steps, "checksum": checksum(dict(weights))})
        return int(global_steps or len(self.updates))


def main(out: Path, sync_ranks: str, group: int) -> None:
    """Two GRPO steps on this rank's slice; writes ``out/rank<R>.json``."""
    model_path = str(ensure_tiny_model())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    manager = RankManager(tokenizer)
    rollout = AgentLoopRollout(manager, sync_ranks=sync_ranks)
    data = Dataset.from_list([
        {"prompt": [{"role": "user", "content": q}], "data_source": "calculator",
         "reward_model": {"ground_truth": str(2 * a + 1)}}
        for a, q in enumerate(QUESTIONS, start=1)])
    args = GRPOConfig(
        output_dir=str(out / "trainer"), max_steps=2, per_device_train_batch_size=4,
        num_generations=group, learning_rate=1e-3, beta=0.0, use_cpu=True, bf16=False, seed=0,
        report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1,
        max_completion_length=16, ddp_backend="gloo")
    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    start = checksum(policy.state_dict())
    trainer = GRPOTrainer(model=policy, args=args, train_dataset=data, processing_class=tokenizer,
                          reward_funcs=[agentloop_reward], rollout_func=rollout,
                          callbacks=[rollout])
    trainer.train()
    rank = trainer.accelerator.process_index
    final = trainer.accelerator.unwrap_model(trainer.model).state_dict()
    result = {
        "rank": rank, "world_size": trainer.accelerator.num_processes,
        "rollouts": manager.rollouts, "updates": manager.updates, "samples": rollout.samples,
        "global_step": trainer.state.global_step, "start_checksum": start,
        "final_checksum": checksum(final),
        "losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
