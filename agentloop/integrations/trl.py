"""agentloop as TRL ``GRPOTrainer``'s rollout backend (docs/trl.md).

    rollout = AgentLoopRollout(manager)              # any AgentLoopManager (any agent loop)
    trainer = GRPOTrainer(model=..., args=GRPOConfig(...), train_dataset=...,
                          reward_funcs=[agentloop_reward], rollout_func=rollout,
                          callbacks=[rollout])

:class:`AgentLoopRollout` is both TRL's ``rollout_func(prompts, trainer)`` and a
``TrainerCallback`` that streams the policy's weights into the manager's servers
(``manager.update_weights``) after every ``sync_every`` optimizer steps.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

try:  # optional dependency: the `trl` extra
    import trl  # noqa: F401
    from accelerate import PartialState
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised only without trl
    raise ImportError(
        "agentloop.integrations.trl needs TRL: pip install 'agentloop[trl]'"
    ) from exc

from agentloop.integrations.trl_fields import (
    FAILED_STATUSES,
    build_batch,
    final_rows,
    index_rows,
    to_trl_fields,
)

__all__ = ["FAILED_STATUSES", "SYNC_RANKS", "AgentLoopRollout", "agentloop_reward"]

SYNC_RANKS = ("all", "main")
"""Which processes stream the weights: ``all`` (each rank into its own manager's servers) or
``main`` (only the main process; every rank waits for it: ranks sharing one set of servers)."""

logger = logging.getLogger(__name__)

PEFT_REFUSED = (
    "agentloop.integrations.trl: PEFT (LoRA) policies are not supported: agentloop's servers load "
    "full weights under the base model's names. Train without peft_config, or sync yourself: "
    "merge the adapter into a copy of the model and call "
    "manager.update_weights(merged.state_dict())"
)
SHARDED_REFUSED = (
    "agentloop.integrations.trl: FSDP-sharded policies are not supported (the weight sync needs "
    "full tensors); use DDP or one process"
)


def agentloop_reward(completions: list[Any], reward: list[float | None] | None = None,
                     failed: list[bool] | None = None, log_metric: Any = None,
                     **kwargs: Any) -> list[float | None]:
    """TRL reward function: the reward agentloop computed for each sample (``rm_scores`` summed;
    None for a failed sample, which TRL then leaves out of its group's baseline with advantage 0).

    Also logs ``agentloop/failed`` (the fraction of failed samples) through TRL's ``log_metric``.

    Raises:
        ValueError: the rollout has no reward (no ``custom_reward_function`` / reward loop in the
            agentloop config).
    """
    if reward is None:
        raise ValueError(
            "agentloop_reward: the rollout carries no 'reward' field; configure a reward in "
            "agentloop (custom_reward_function, or a loop that sets reward_score) or use your own "
            "TRL reward functions"
        )
    if failed is not None and log_metric is not None and failed:
        log_metric("agentloop/failed", sum(failed) / len(failed))
    return list(reward)


class AgentLoopRollout(TrainerCallback):  # type: ignore[misc]
    """TRL's ``rollout_func`` and weight-sync callback on an agentloop manager.

    Args:
        manager: an ``AgentLoopManager`` (anything with ``generate_sequences(DataProto)``,
            ``update_weights(state_dict, global_steps=...)`` and ``tokenizer``).
        sync_every: stream the weights after every ``sync_every``-th optimizer step (and at the
            end of training when the last step was not synced).
        sync_on_train_begin: also stream them once before the first step (when the trainer's
            model is not the checkpoint the servers loaded).
        dataset: rows to look up each prompt's other columns in (``agent_name``, ``reward_model``,
            ``extra_info``...); default: the trainer's train and eval datasets, read on the first
            call (an ``IterableDataset`` is skipped).
        failed_reward: the reward of a failed sample; None (default) makes it unscorable for TRL.
        sync_ranks: under ``accelerate launch`` with several processes, ``all`` (default: every
            rank has its own manager and syncs it) or ``main`` (the ranks' managers share one
            set of servers: the main process syncs, every rank waits for it before rolling out
            again); docs/trl.md#multi-process-accelerate.

    Raises:
        ValueError: a bad ``sync_every`` or ``sync_ranks``.

    Attributes:
        samples, failed: samples returned and failed ones so far (``failed`` by status).
        syncs: weight updates done; last_synced_step: the step of the last one.
    """

    def __init__(self, manager: Any, *, sync_every: int = 1, sync_on_train_begin: bool = False,
                 dataset: Iterable[Mapping[str, Any]] | None = None,
                 failed_reward: float | None = None, sync_ranks: str = "all") -> None:
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be a positive int, got {sync_every!r}")
        if sync_ranks not in SYNC_RANKS:
            raise ValueError(f"sync_ranks must be one of {SYNC_RANKS}, got {sync_ranks!r}")
        self.sync_ranks = sync_ranks
        self.manager = manager
        self.sync_every = sync_every
        self.sync_on_train_begin = sync_on_train_begin
        self.failed_reward = failed_reward
        self._fields = None if dataset is None else index_rows(dataset)
        self._calls = 0
        self.trainer: Any = None
        self.samples = 0
        self.failed: Counter[str] = Counter()
        self.syncs = 0
        self.last_synced_step: int | None = None

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        """TRL's ``rollout_func``: roll out this process's prompts (each already repeated
        ``num_generations`` times) and return TRL's fields (docs/trl.md#the-field-mapping)."""
        self.trainer = trainer
        if self._fields is None:
            self._fields = index_rows(_dataset_rows(trainer))
        batch = build_batch(
            prompts, group_size=_group_size(trainer), tag=f"trl{self._calls}",
            first_index=_process_index(trainer) * len(prompts), fields=self._fields,
        )
        self._calls += 1
        out = self.manager.generate_sequences(batch)
        result = to_trl_fields(
            out, final_rows(out, len(prompts)), pad_token_id=_pad_token_id(self.manager),
            input_columns=batch.non_tensor_batch.keys(), failed_reward=self.failed_reward,
        )
        self.samples += len(prompts)
        self.failed.update(result.failed)
        if result.failed:
            logger.warning(
                "agentloop: %d of %d samples failed (%s): env_mask 0, reward %s (%d failed so far)",
                sum(result.failed.values()), len(prompts), dict(result.failed),
                self.failed_reward, sum(self.failed.values()),
            )
        return result.fields

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       **kwargs: Any) -> None:
        """Refuse a PEFT or sharded policy before the first step; sync if asked."""
        self._full_model(model)
        if self.sync_on_train_begin:
            self.sync(model, state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None,
                    **kwargs: Any) -> None:
        """After an optimizer step: stream the weights every ``sync_every`` steps."""
        if state.global_step % self.sync_every == 0:
            self.sync(model, state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None,
                     **kwargs: Any) -> None:
        """Stream the final weights when the last step was not synced."""
        if state.global_step > 0 and self.last_synced_step != state.global_step:
            self.sync(model, state.global_step)

    def sync(self, model: Any, step: int) -> int | None:
        """Stream ``model``'s full weights into the manager's servers as version ``step`` (with
        ``sync_ranks="main"``: on the main process only, then every process waits for it);
        returns the servers' new version, None on a process that did not stream.

        Raises:
            ValueError: a PEFT or FSDP-sharded model.
        """
        policy = self._full_model(model)
        ranks = PartialState() if self.sync_ranks == "main" else None
        version = None
        if ranks is None or ranks.is_main_process:
            version = int(self.manager.update_weights(policy.state_dict(), global_steps=step))
            self.syncs += 1
        if ranks is not None:
            ranks.wait_for_everyone()  # no rank rolls out before the servers hold the new weights
        self.last_synced_step = step
        return version

    def _full_model(self, model: Any) -> Any:
        """The unwrapped policy; raises ValueError for PEFT or FSDP."""
        if model is None and self.trainer is not None:
            model = self.trainer.model
        if model is None:
            raise ValueError("agentloop.integrations.trl: no model to sync")
        if self.trainer is not None and getattr(self.trainer, "is_fsdp_enabled", False):
            raise ValueError(SHARDED_REFUSED)
        accelerator = getattr(self.trainer, "accelerator", None)
        if accelerator is not None:
            model = accelerator.unwrap_model(model)
        model = getattr(model, "module", model)  # DDP without a trainer at hand
        if hasattr(model, "peft_config") or type(model).__name__.startswith("Peft"):
            raise ValueError(PEFT_REFUSED)
        return model


def _group_size(trainer: Any) -> int:
    """TRL's group size for the current mode (train or eval)."""
    training = bool(getattr(getattr(trainer, "model", None), "training", True))
    if not training and getattr(trainer, "num_generations_eval", None):
        return int(trainer.num_generations_eval)
    return int(getattr(trainer, "num_generations", 1) or 1)


def _process_index(trainer: Any) -> int:
    accelerator = getattr(trainer, "accelerator", None)
    return int(getattr(accelerator, "process_index", 0))


def _pad_token_id(manager: Any) -> int:
    tokenizer = manager.tokenizer
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", 0)
    return int(pad or 0)


def _dataset_rows(trainer: Any) -> Iterable[Mapping[str, Any]]:
    """Rows of the trainer's train and eval datasets (map-style only)."""
    datasets: list[Any] = [getattr(trainer, "train_dataset", None)]
    evals = getattr(trainer, "eval_dataset", None)
    datasets += list(evals.values()) if isinstance(evals, dict) else [evals]
    for data in datasets:
        if data is None or not hasattr(data, "__len__"):
            continue
        yield from data
