"""Padding a flat list of AgentLoopOutput into the trainer's DataProto layout (verl's, DESIGN §4).

* ``prompts`` [B, P]: left-padded with ``pad_token_id`` (a longer prompt keeps its last P tokens);
* ``responses`` [B, R]: right-padded (a longer response keeps its first R tokens);
* ``input_ids`` = cat(prompts, responses); ``attention_mask`` 1 on real tokens;
* ``position_ids`` = clip(cumsum(attention_mask) - 1, 0);
* ``response_mask`` [B, R]: the loop's mask (1 = sampled by the policy) times the response attention;
* ``rollout_log_probs`` [B, R] float32 when requested (0.0 on padding and for outputs without logprobs);
* ``rm_scores`` [B, R] float32, the score on the last response token, when every output has one.

Non-tensor: ``__num_turns__``, ``status``, ``error``, each ``extra_fields`` key (None where absent),
``multi_modal_data`` when any output has it, and the given per-row sample fields.
Padding is vectorised: one boolean-mask assignment per tensor, no per-sample tokenizer calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from agentloop.protocol import DataProto
from agentloop.types import AgentLoopOutput


def _lengths(seqs: Sequence[Sequence[Any]], length: int) -> np.ndarray:
    return np.fromiter((min(len(s), length) for s in seqs), dtype=np.int64, count=len(seqs))


def _valid(lens: np.ndarray, length: int, left: bool) -> np.ndarray:
    cols = np.arange(length)[None, :]
    return cols >= (length - lens)[:, None] if left else cols < lens[:, None]


def pad_sequences(
    seqs: Sequence[Sequence[Any]], length: int, pad_value: Any, *, left: bool, dtype: Any = np.int64
) -> tuple[np.ndarray, np.ndarray]:
    """Pad (and cut) ragged sequences to ``[B, length]``; returns (values, valid-mask)."""
    lens = _lengths(seqs, length)
    out = np.full((len(seqs), length), pad_value, dtype=dtype)
    valid = _valid(lens, length, left)
    if len(seqs) and lens.sum():
        kept = [s[len(s) - n:] if left else s[:n] for s, n in zip(seqs, lens.tolist(), strict=True)]
        out[valid] = np.concatenate([np.asarray(k, dtype=dtype) for k in kept if len(k)])
    return out, valid


def _object_column(values: list[Any]) -> np.ndarray:
    arr = np.empty(len(values), dtype=object)
    arr[:] = values
    return arr


def _tensors(
    outputs: list[AgentLoopOutput], prompt_length: int, response_length: int, pad_token_id: int,
    calculate_log_probs: bool,
) -> dict[str, torch.Tensor]:
    prompts, p_valid = pad_sequences([o.prompt_ids for o in outputs], prompt_length, pad_token_id, left=True)
    responses, r_valid = pad_sequences([o.response_ids for o in outputs], response_length, pad_token_id, left=False)
    mask, _ = pad_sequences([o.response_mask for o in outputs], response_length, 0, left=False)
    attention = np.concatenate([p_valid, r_valid], axis=1).astype(np.int64)
    position = np.clip(np.cumsum(attention, axis=1) - 1, 0, None)
    t = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": mask * r_valid,
        "input_ids": np.concatenate([prompts, responses], axis=1),
        "attention_mask": attention,
        "position_ids": position,
    }
    if calculate_log_probs:
        logprobs = [o.response_logprobs if o.response_logprobs is not None else [0.0] * len(o.response_ids)
                    for o in outputs]
        t["rollout_log_probs"], _ = pad_sequences(logprobs, response_length, 0.0, left=False, dtype=np.float32)
    if outputs and all(o.reward_score is not None for o in outputs):
        scores = np.zeros((len(outputs), response_length), dtype=np.float32)
        last = np.maximum(r_valid.sum(axis=1) - 1, 0)
        scores[np.arange(len(outputs)), last] = [float(o.reward_score) for o in outputs]  # type: ignore[arg-type]
        t["rm_scores"] = scores
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in t.items()}


def postprocess(
    outputs: list[AgentLoopOutput],
    *,
    prompt_length: int,
    response_length: int,
    pad_token_id: int,
    sample_fields: dict[str, np.ndarray] | None = None,
    calculate_log_probs: bool = False,
) -> DataProto:
    """Pad ``outputs`` (one per row) into a DataProto; ``sample_fields`` are per-row object arrays."""
    tensors = _tensors(outputs, prompt_length, response_length, pad_token_id, calculate_log_probs)
    non_tensor: dict[str, np.ndarray] = {
        "__num_turns__": np.array([o.num_turns for o in outputs], dtype=np.int32),
        "status": _object_column([o.status.value for o in outputs]),
        "error": _object_column([o.error for o in outputs]),
    }
    extra_keys = sorted({k for o in outputs for k in o.extra_fields})
    for key in extra_keys:
        non_tensor[key] = _object_column([o.extra_fields.get(key) for o in outputs])
    if any(o.multi_modal_data for o in outputs):
        non_tensor["multi_modal_data"] = _object_column([o.multi_modal_data for o in outputs])
    for key, values in (sample_fields or {}).items():
        if len(values) != len(outputs):
            raise ValueError(f"sample field {key!r} has {len(values)} rows for {len(outputs)} outputs")
        non_tensor.setdefault(key, values)
    batch = TensorDict(tensors, batch_size=[len(outputs)])
    metrics = [o.metrics.model_dump() for o in outputs]
    return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info={"metrics": metrics})
