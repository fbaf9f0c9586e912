"""GRPO on the calculator task, written against agentloop's public API only.

The pieces ``train.py`` (the example) and ``tests/integration/test_grpo_smoke.py`` share:

* :func:`rollout_config`: the rollout config (defaults ← ``agentloop/configs/cpu_train.yaml`` ← this
  task: ``tool_agent`` with the calculator tool, lengths, temperature);
* :func:`make_batch`: dataset rows → a batch of ``n`` samples per prompt sharing a ``uid``
  (:func:`agentloop.batch.data.repeat_for_rollout`, verl's contract);
* :func:`sequence_rewards`: the rollout's ``rm_scores`` / ``reward_valid`` when it has them (the
  workers run ``custom_reward_function``, here ``agentloop.rewards.calculator.compute_score``), else
  the same answer match on the decoded response, in the driver;
* :func:`group_advantages`: GRPO's outcome advantage, ``(r - mean) / (std + eps)`` within each
  ``uid`` group (rows without a valid reward are left out and get 0);
* :func:`response_log_probs`: the policy's fp32 log-probs of the sampled response tokens (HF
  recompute);
* :func:`ppo_clip_loss` and :func:`train_on_rollout`: PPO's clipped objective against the rollout's
  ``rollout_log_probs`` (the behaviour policy is the served one), token-mean over sampled tokens,
  one optimizer step per mini-batch, skipped when every advantage of the mini-batch is zero (AdamW
  would still move the weights through its moment estimates);
* :func:`greedy_success`: the fraction of held-out problems answered right with greedy decoding
  (``validate``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from agentloop import DataProto
from agentloop.batch.data import repeat_for_rollout, rows_to_batch
from agentloop.config import CONFIG_DIR, default_config
from agentloop.testing.tiny_model import word_problem_rows

REPO = Path(__file__).resolve().parents[2]
TOOLS_YAML = REPO / "examples" / "calculator_agent" / "tools.yaml"
DATA_SOURCE = "calculator"

ScoreFn = Callable[..., float]


@dataclass
class GRPOConfig:
    """Hyper-parameters of the example (the defaults are the measured run in README.md)."""

    steps: int = 60
    """Rollout + update rounds (30 reached +0.06 to +0.22 greedy; 60: README.md)."""
    prompts_per_step: int = 16
    """Distinct problems per round."""
    n: int = 8
    """Samples per problem (the GRPO group)."""
    lr: float = 1e-4
    """AdamW learning rate (constant)."""
    clip_ratio: float = 0.2
    """PPO clip range: the ratio to the rollout policy is clipped to ``[1 - c, 1 + c]``."""
    mini_batches: int = 2
    """Optimizer steps per round (the round's groups are split between them; later ones are
    off-policy)."""
    max_grad_norm: float = 1.0
    """Gradient clipping."""
    temperature: float = 1.0
    """Sampling temperature of the rollout (the recompute divides the logits by it too)."""
    eval_problems: int = 256
    """Held-out problems for the greedy evaluation before and after training (64 left a ±0.05
    sampling error on the gain)."""
    seed: int = 0
    """Seed of the training problems and their order, torch and vLLM's sampling."""
    eval_seed: int = 1000
    """Seed of the held-out problems (the same set for every ``seed``, so runs compare)."""
    async_rollout: bool = False
    """Generate ahead of training with the Rollouter (``--async``)."""


def rollout_config(model_path: str | Path, *, temperature: float = 1.0, prompt_length: int = 320,
                   response_length: int = 128, num_servers: int = 1, score_in_workers: bool = True,
                   seed: int | None = None, **overrides: Any) -> DictConfig:
    """The rollout config: agentloop's defaults ← the ``cpu_train`` preset ← this task ←
    ``overrides`` (dotted keys, e.g. ``{"actor_rollout_ref.rollout.max_num_seqs": 64}``).  With
    ``score_in_workers`` the workers score every trajectory (``custom_reward_function``: the
    calculator answer match) into ``rm_scores``; ``seed`` (None: the preset's) seeds vLLM's
    sampling (``actor_rollout_ref.rollout.seed``)."""
    cfg: Any = OmegaConf.merge(default_config(), OmegaConf.load(CONFIG_DIR / "cpu_train.yaml"))
    task = {
        "actor_rollout_ref.model.path": str(model_path), "data.max_prompt_length": prompt_length,
        "data.max_response_length": response_length,
        "actor_rollout_ref.rollout.temperature": temperature,
        "actor_rollout_ref.rollout.server.num_servers": num_servers,
        "actor_rollout_ref.rollout.agent.default_agent_loop": "tool_agent",
        "actor_rollout_ref.rollout.multi_turn.enable": True,
        "actor_rollout_ref.rollout.multi_turn.format": "hermes",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 3,
        "actor_rollout_ref.rollout.multi_turn.tool_config_path": str(TOOLS_YAML),
    }
    if seed is not None:
        task["actor_rollout_ref.rollout.seed"] = seed
    if score_in_workers:
        task["custom_reward_function.path"] = "agentloop.rewards.calculator"
        task["custom_reward_function.name"] = "compute_score"
    for key, value in {**task, **overrides}.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg  # type: ignore[no-any-return]


def problem_rows(count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` arithmetic word problems in verl's dataset format, routed to ``tool_agent``."""
    return word_problem_rows(count, agent_name="tool_agent", data_source=DATA_SOURCE, seed=seed)


def make_batch(rows: list[dict[str, Any]], n: int) -> DataProto:
    """One row per problem with its own ``uid``, then ``n`` interleaved copies (what verl's
    trainer sends)."""
    return repeat_for_rollout(rows_to_batch(rows), n)


def calculator_score_fn() -> ScoreFn:
    """``agentloop.rewards.calculator.compute_score`` (verl's ``compute_score`` signature); where
    this agentloop has no such module, the same rule through
    ``agentloop.rewards.final_answer_match``."""
    try:
        from agentloop.rewards.calculator import compute_score

        return compute_score  # type: ignore[no-any-return]
    except ImportError:
        from agentloop.rewards import final_answer_match

        def score(
            data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None
        ) -> float:
            return final_answer_match([{"role": "assistant", "content": solution_str}],
                                      reward_model={"ground_truth": ground_truth})

        return score


def decoded_responses(out: DataProto, tokenizer: Any) -> list[str]:
    """Each row's response (sampled turns and tool turns) as text, special tokens dropped."""
    assert out.batch is not None
    responses, mask = (
        out.batch["responses"],
        out.batch["attention_mask"][:, -out.batch["responses"].shape[1] :],
    )
    return [tokenizer.decode(responses[i][mask[i].bool()].tolist(), skip_special_tokens=True)
            for i in range(len(out))]


def sequence_rewards(out: DataProto, tokenizer: Any, score_fn: ScoreFn | None = None, *,
                     use_rm_scores: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(reward, valid)`` per row.

    The rollout's ``rm_scores`` summed over the response, valid where ``reward_valid`` says so (all
    rows in verl's layout, which has no ``reward_valid``), when the rollout carries them and
    ``use_rm_scores``; else ``score_fn`` (default :func:`calculator_score_fn`) on the decoded
    response and ``reward_model.ground_truth``, valid unless the scorer raises ``ValueError`` (e.g.
    no ground truth).  Invalid rows have reward 0.
    """
    assert out.batch is not None
    keys = set(out.batch.keys())  # TensorDict: `in` alone is not a key lookup
    if use_rm_scores and "rm_scores" in keys:
        valid = (
            out.batch["reward_valid"].bool()
            if "reward_valid" in keys
            else torch.ones(len(out), dtype=torch.bool)
        )
        return out.batch["rm_scores"].float().sum(-1) * valid, valid
    score_fn = score_fn or calculator_score_fn()
    nt = out.non_tensor_batch
    rewards, valid_rows = [], []
    for i, text in enumerate(decoded_responses(out, tokenizer)):
        truth = (nt["reward_model"][i] or {}).get("ground_truth")
        try:
            rewards.append(float(score_fn(nt["data_source"][i], text, truth, nt["extra_info"][i])))
            valid_rows.append(True)
        except ValueError:
            rewards.append(0.0)
            valid_rows.append(False)
    return torch.tensor(rewards, dtype=torch.float32), torch.tensor(valid_rows, dtype=torch.bool)


def group_advantages(rewards: torch.Tensor, uids: np.ndarray, valid: torch.Tensor | None = None,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO's outcome advantage per row: ``(r - mean) / (std + eps)`` over the valid rows sharing
    its ``uid`` (unbiased std).  Invalid rows, groups with fewer than two valid rows and groups of
    equal rewards get 0."""
    advantages = torch.zeros_like(rewards)
    for rows in group_rows(uids):
        kept = [i for i in rows if valid is None or bool(valid[i])]
        if len(kept) < 2:
            continue
        r = rewards[kept]
        advantages[kept] = (r - r.mean()) / (r.std() + eps)
    return advantages


def response_log_probs(policy: Any, batch: Any, temperature: float = 1.0) -> torch.Tensor:
    """``[B, R]`` log-probs under ``policy`` of each response token given everything before it (0 on
    padding).

    The rows are re-packed without their left padding (prompt, then response, then right padding),
    so the forward pass needs no attention mask or position ids; the output layer runs on response
    positions only.
    """
    prompts, responses, attention = batch["prompts"], batch["responses"], batch["attention_mask"]
    rows, p_width, r_width = prompts.shape[0], prompts.shape[1], responses.shape[1]
    p_len = attention[:, :p_width].sum(-1)
    # padding after the tokens: unseen
    ids = torch.zeros((rows, int(p_len.max()) + r_width), dtype=torch.long)
    for i in range(rows):
        n = int(p_len[i])
        ids[i, :n] = prompts[i, p_width - n:]
        ids[i, n:n + r_width] = responses[i]
    hidden = policy.model(input_ids=ids).last_hidden_state
    # response token j of row i sits at p_len[i] + j and is predicted from position p_len[i] + j - 1
    where = p_len[:, None] - 1 + torch.arange(r_width)[None, :]
    picked = hidden.gather(1, where[..., None].expand(-1, -1, hidden.shape[-1]))
    logits = policy.lm_head(picked).float() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, responses[..., None])[..., 0]
    return logp * attention[:, p_width:].to(logp.dtype)


def ppo_clip_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    clip_ratio: float,
) -> tuple[torch.Tensor, float]:
    """PPO's clipped surrogate, token-mean over ``mask``; returns (loss, fraction of tokens
    clipped)."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    unclipped, clipped = ratio * adv, ratio.clamp(1 - clip_ratio, 1 + clip_ratio) * adv
    per_token = -torch.minimum(unclipped, clipped)
    m = mask.to(per_token.dtype)
    tokens = m.sum().clamp(min=1)
    clipfrac = float(((clipped < unclipped).to(m.dtype) * m).sum() / tokens)
    return (per_token * m).sum() / tokens, clipfrac


def group_rows(uids: np.ndarray) -> list[list[int]]:
    """Row indices of each ``uid`` group, in order of first appearance."""
    groups: dict[Any, list[int]] = {}
    for i, uid in enumerate(uids.tolist()):
        groups.setdefault(uid, []).append(i)
    return list(groups.values())


def train_on_rollout(
    policy: Any, optimizer: torch.optim.Optimizer, out: DataProto, advantages: torch.Tensor,
    cfg: GRPOConfig,
) -> dict[str, float]:
    """PPO-clip updates on one rollout: ``cfg.mini_batches`` optimizer steps, each over whole
    ``uid`` groups.

    Returns ``loss`` (mean over the steps taken), ``clipfrac``, ``updates`` (steps taken: a
    mini-batch whose advantages are all zero is skipped) and ``logprob_gap_mean`` /
    ``logprob_gap_max``: |recomputed
    - rollout| log-prob over the sampled tokens of the first mini-batch, before any update (the
    engine served exactly these weights; fp32 kernels differ by ~2e-7 on average, up to ~1e-4 on
    single tokens).
    """
    assert out.batch is not None
    groups = group_rows(out.non_tensor_batch["uid"])
    parts = [[row for g in chunk for row in groups[g]]
             for chunk in np.array_split(np.arange(len(groups)), cfg.mini_batches) if len(chunk)]
    losses, clipfracs, gap = [], [], (float("nan"), float("nan"))
    for k, rows in enumerate(parts):
        idx = torch.as_tensor(rows)
        sub, adv = out.batch[idx], advantages[idx]
        if k > 0 and not bool(adv.ne(0).any()):
            continue
        mask, old = sub["response_mask"].bool(), sub["rollout_log_probs"].float()
        logp = response_log_probs(policy, sub, cfg.temperature)
        if k == 0:
            diff = (logp.detach() - old).abs()[mask]
            if diff.numel():  # else every row of the mini-batch failed before sampling anything
                gap = (float(diff.mean()), float(diff.max()))
            if not bool(adv.ne(0).any()):
                continue
        loss, clipfrac = ppo_clip_loss(logp, old, adv, mask, cfg.clip_ratio)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
        optimizer.step()
        losses.append(float(loss.detach()))
        clipfracs.append(clipfrac)
    return {"loss": _mean(losses), "clipfrac": _mean(clipfracs), "updates": float(len(losses)),
            "logprob_gap_mean": gap[0], "logprob_gap_max": gap[1]}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def greedy_success(
    manager: Any, rows: list[dict[str, Any]], score_fn: ScoreFn | None = None
) -> float:
    """Mean reward of a greedy rollout (``meta_info["validate"]``: the ``val_kwargs`` sampling)
    of ``rows``."""
    batch = make_batch(rows, 1)
    batch.meta_info["validate"] = True
    out = manager.generate_sequences(batch)
    rewards, _ = sequence_rewards(out, manager.tokenizer, score_fn)
    return float(rewards.mean())


def load_policy(model_path: str | Path) -> Any:
    """The trainable HF policy: the checkpoint's ``Qwen2ForCausalLM`` in fp32."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    policy.train()
    return policy

