"""One rank of test_trl_multiprocess.py: TRL 1.16's GRPOTrainer on 2 CPU processes (DDP on gloo)
with ``AgentLoopRollout`` on a scripted engine (no vLLM).

    torchrun --standalone --nproc_per_node 2 tests/integration/trl_ddp_rank.py OUT SYNC GROUP

(``accelerate launch --cpu`` starts several CPU processes only through mpirun; torchrun sets the
environment accelerate reads, and ``use_cpu`` makes the group gloo.) ``SYNC`` is
``AgentLoopRollout``'s ``sync_ranks``: ``all``: each rank has a manager of its own (an in-process
worker on its own scripted engine, no Ray); ``main``: the ranks share one server (rank 0 starts
Ray and a ScriptedServer actor and broadcasts the cluster's address, then the server's handle;
rank 1 joins the cluster; each rank opens an ``AgentLoopManager`` over the server as
``llm_client``) and only rank 0 streams the weights.
``GROUP`` is TRL's ``num_generations`` (4: each rank rolls out its own problem; 8: one group split
between the ranks). Each rank writes ``OUT/rank<R>.json``: the prompts, uids and weight versions
its rollouts got, the weight updates its manager made (step and the weights' checksum), the
trainer's final step and its final weights' checksum.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist
from accelerate import PartialState
from datasets import Dataset
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from agentloop.config import default_config
from agentloop.integrations.trl import AgentLoopRollout, agentloop_reward
from agentloop.rollout.manager import AgentLoopManager
from agentloop.rollout.worker import AgentLoopWorker
from agentloop.routing import AsyncLLMServerManager
from agentloop.testing import ScriptedServer
from agentloop.testing.tiny_model import ensure_tiny_model

QUESTIONS = [f"what is {a} plus {a + 1}" for a in range(1, 9)]
"""Eight distinct problems; the answer of ``a plus a + 1`` is ``2a + 1``."""


def checksum(weights: dict[str, torch.Tensor]) -> float:
    """A float64 sum of every parameter's values (equal weights give equal sums)."""
    return float(sum(t.detach().double().sum().item() for t in weights.values()))


def agentloop_config(model_path: str) -> Any:
    """The rollout config: single_turn, the calculator reward, short lengths, one worker."""
    cfg = default_config()
    cfg.actor_rollout_ref.model.path = model_path
    cfg.data.max_prompt_length = 64
    cfg.data.max_response_length = 16
    cfg.actor_rollout_ref.rollout.calculate_log_probs = True
    cfg.actor_rollout_ref.rollout.agent.num_workers = 1
    cfg.custom_reward_function.path = "agentloop.rewards.calculator"
    cfg.custom_reward_function.name = "compute_score"
    OmegaConf.resolve(cfg)
    return cfg


class Replier:
    """The scripted engine's replies, "The answer is N." right and wrong in turn (so that each
    group's rewards differ); the tokenizer is loaded where it runs (a Ray actor or this rank)."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self.tokenizer: Any = None
        self.calls = 0

    def __call__(self, ids: list[int], params: dict[str, Any], rid: str) -> list[int]:
        if self.tokenizer is None:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.calls += 1
        text = self.tokenizer.decode(ids)
        a = next(a for a in range(8, 0, -1) if f"what is {a} plus" in text)
        answer = 2 * a + 1 + self.calls % 2  # right on even calls, wrong on odd ones
        return [*self.tokenizer.encode(f"The answer is {answer}.", add_special_tokens=False),
                self.tokenizer.convert_tokens_to_ids("<|im_end|>")]


class LocalManager:
    """The manager surface AgentLoopRollout uses, on an in-process worker and this rank's own
    scripted engine (``sync_ranks="all"``)."""

    def __init__(self, model_path: str) -> None:
        cfg = agentloop_config(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.server = ScriptedServer(Replier(model_path), eos_token_id=end)
        self.worker = AgentLoopWorker.from_slices(
            cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model, [self.server],
            tokenizer=self.tokenizer, trainer_config=cfg)

    def generate_sequences(self, batch: Any) -> Any:
        return asyncio.run(self.worker.generate_sequences(batch))

    def update_weights(self, weights: Any, *, global_steps: int | None = None) -> int:
        asyncio.run(self.server.update_weights(list(weights.items()), global_steps=global_steps))
        return self.server.global_steps


class Recorder:
    """Wraps a manager: records each rollout's prompts, uids and weight versions, and each weight
    update (its step and the weights' checksum)."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.tokenizer = manager.tokenizer
        self.rollouts: list[dict[str, Any]] = []
        self.updates: list[dict[str, Any]] = []

    def generate_sequences(self, batch: Any) -> Any:
        out = self.manager.generate_sequences(batch)
        versions = out.non_tensor_batch["min_global_steps"]
        self.rollouts.append({
            "prompts": [m[-1]["content"] for m in batch.non_tensor_batch["raw_prompt"]],
            "uids": [str(u) for u in batch.non_tensor_batch["uid"]],
            "versions": [None if v is None else int(v) for v in versions],
        })
        return out

    def update_weights(self, weights: Any, *, global_steps: int | None = None) -> int:
        weights = dict(weights)
        self.updates.append({"step": global_steps, "checksum": checksum(weights)})
        return int(self.manager.update_weights(weights, global_steps=global_steps))


def shared_manager(model_path: str) -> tuple[Any, Callable[[], None]]:
    """Rank 0 starts Ray and the server; rank 1 joins the cluster and gets the server's handle
    (broadcast, pickled); each rank opens a manager over it. Returns the manager and the function
    that ends this rank's part."""
    dist.init_process_group("gloo")  # accelerate takes this group over
    address: list[Any] = [None]
    handles: list[Any] = [None]
    if dist.get_rank() == 0:
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
        end = AutoTokenizer.from_pretrained(model_path).convert_tokens_to_ids("<|im_end|>")
        server = ray.remote(num_cpus=0)(ScriptedServer).options(max_concurrency=100).remote(
            Replier(model_path), eos_token_id=end)
        ray.get(server.start.remote())
        address, handles = [ray.get_runtime_context().gcs_address], [server]
    dist.broadcast_object_list(address, src=0)
    if dist.get_rank():
        ray.init(address=address[0], logging_level="ERROR")  # before the handle is unpickled
    dist.broadcast_object_list(handles, src=0)
    manager = AgentLoopManager(agentloop_config(model_path),
                               llm_client=AsyncLLMServerManager(handles))

    def close() -> None:
        PartialState().wait_for_everyone()  # rank 0 keeps the server until rank 1 is done
        manager.shutdown()
        ray.shutdown()

    return manager, close


def main(out: Path, sync_ranks: str, group: int) -> None:
    """Two GRPO steps on this rank's slice; writes ``out/rank<R>.json``."""
    model_path = str(ensure_tiny_model())
    if sync_ranks == "main":
        inner, close = shared_manager(model_path)
    else:
        inner, close = LocalManager(model_path), lambda: None
    manager = Recorder(inner)
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
    trainer = GRPOTrainer(model=policy, args=args, train_dataset=data,
                          processing_class=manager.tokenizer, reward_funcs=[agentloop_reward],
                          rollout_func=rollout, callbacks=[rollout])
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
    close()


if __name__ == "__main__":
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
