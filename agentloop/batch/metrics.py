"""Driver-side helpers for the manager's output: aligning worker chunks' columns and the batch
timing metrics."""

from __future__ import annotations

import array
import time
from collections import Counter
from operator import itemgetter
from typing import Any

import numpy as np
import torch

from agentloop.batch.protocol import DataProto
from agentloop.errors import DatasetError
from agentloop.rewards.columns import complete_reward_columns


def align_keys(parts: list[DataProto]) -> list[DataProto]:
    """Give every worker's chunk the same columns before concatenation, inventing no values.

    * Reward columns: when any chunk has ``rm_scores``, a chunk without them gets them by the one
      rule of :mod:`agentloop.rewards.columns` (it had no reward source, so each of its rows is
      ``reward_valid`` 0 with a ``reward_error``), and ``meta_info["reward_extra_keys"]`` becomes
      the union over the chunks.
    * Any other tensor column must come from every chunk: a zero-filled row would read as data, so a
      chunk without it is a :class:`DatasetError`.
    * A non-tensor column missing from a chunk (an extra field only some loops set,
      ``prompt_truncated`` absent from a chunk whose samples all failed) is None on that chunk's
      rows.
    * ``meta_info["timing"]``, when the parts' differ (each part of ``generate_sequences_stream``
      has its own), is removed from every part: it described one part, not the whole (read it from
      each part first); ``DataProto.concat`` refuses differing ``meta_info`` values.
    """
    # TensorDict: `in` is not key lookup
    keys = [list(p.batch.keys()) if p.batch is not None else [] for p in parts]
    with_scores = [p.batch["rm_scores"] for p, ks in zip(parts, keys, strict=True)
                   if p.batch is not None and "rm_scores" in ks]
    if with_scores:
        for p in parts:
            complete_reward_columns(p, with_scores[0])
        extra_keys = list(
            dict.fromkeys(k for p in parts for k in p.meta_info.get("reward_extra_keys") or [])
        )
        for p in parts:
            p.meta_info["reward_extra_keys"] = extra_keys
        keys = [list(p.batch.keys()) if p.batch is not None else [] for p in parts]
    tensor_keys = list(dict.fromkeys(k for ks in keys for k in ks))
    for i, present in enumerate(keys):
        missing = [k for k in tensor_keys if k not in present]
        if missing:
            raise DatasetError(
                f"worker chunk {i} of {len(parts)} lacks the tensor column(s) {missing} "
                f"that other chunks have; "
                "filling them would invent values. A tensor column must be built for every "
                "row by every worker "
                "(agentloop.batch.postprocess does so for its own columns; a custom column "
                "needs the same rule)"
            )
    non_tensor_keys = set().union(*(p.non_tensor_batch for p in parts)) if parts else set()
    for p in parts:
        for k in non_tensor_keys - set(p.non_tensor_batch):
            p.non_tensor_batch[k] = np.full(len(p), None, dtype=object)
    timings = [p.meta_info.get("timing") for p in parts]
    if any(t != timings[0] for t in timings[1:]):
        for p in parts:
            p.meta_info.pop("timing", None)
    return parts


def after_last_sample(done_at: list[float]) -> dict[str, float]:
    """``agent_loop/serial/after_last_sample``: seconds from the moment the batch's last sample
    finished (``done_at``: each part's ``time.time()`` then; 0.0 for rows no worker rolled out) to
    now (padding, transfer, concat and checks); empty when no part says."""
    last = max(done_at, default=0.0)
    if not last:
        return {}
    return {"agent_loop/serial/after_last_sample": max(0.0, time.time() - last)}


def performance_metrics(output: DataProto, wall: float) -> dict[str, float]:
    """verl's ``agent_loop/*`` timing keys (``compute_score``: seconds in the reward function) plus
    status counts, the truncated-prompt count, trajectories per sample and, with reward columns,
    ``agent_loop/reward/num_invalid``."""
    metrics = output.meta_info.get("metrics", [])
    timing: dict[str, float] = {"agent_loop/wall": wall}
    if not metrics:
        return timing
    # generate, tool and score seconds as the rows of one (3, n) array, each column read in C
    # (each row contiguous, so its mean sums as a 1-D array's does)
    n = len(metrics)
    gen = array.array("d", map(itemgetter("generate_sequences"), metrics))
    tool = array.array("d", map(itemgetter("tool_calls"), metrics))
    try:
        score = array.array("d", map(itemgetter("compute_score"), metrics))
    except KeyError:  # rows without a reward function's time
        score = array.array("d", (m.get("compute_score", 0.0) for m in metrics))
    times = np.frombuffer(gen + tool + score, dtype=np.float64).reshape(3, n)
    lows, highs = times.min(axis=1).tolist(), times.max(axis=1).tolist()
    means = times.mean(axis=1).tolist()
    slowest = int(np.argmax(times[0] + times[1] + times[2]))
    names = ("generate_sequences", "tool_calls", "compute_score")
    for j, name in enumerate(names):
        timing[f"agent_loop/{name}/min"] = lows[j]
        timing[f"agent_loop/{name}/max"] = highs[j]
        timing[f"agent_loop/{name}/mean"] = means[j]
    for j, name in enumerate(names):
        timing[f"agent_loop/slowest/{name}"] = float(times[j, slowest])
    assert output.batch is not None
    attention = _array(output.batch["attention_mask"])
    prompt_len = output.batch["prompts"].shape[1]
    timing["agent_loop/slowest/prompt_length"] = float(attention[slowest, :prompt_len].sum())
    timing["agent_loop/slowest/response_length"] = float(attention[slowest, prompt_len:].sum())
    for status, count in Counter(output.non_tensor_batch["status"].tolist()).items():
        timing[f"agent_loop/status/{status}"] = float(count)
    truncated = output.non_tensor_batch.get("prompt_truncated")
    if truncated is not None:
        timing["agent_loop/num_truncated_prompts"] = float(sum(1 for t in truncated.tolist() if t))
    if "reward_valid" in list(output.batch.keys()):
        timing["agent_loop/reward/num_invalid"] = float((output.batch["reward_valid"] == 0).sum())
    timing.update(_episode_metrics(output))
    return timing


def _array(tensor: Any) -> Any:
    """A CPU tensor as a numpy view (cheaper than torch for a few small sums), else itself."""
    cpu = isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu"
    return tensor.numpy() if cpu and not tensor.requires_grad else tensor


def _episode_metrics(output: DataProto) -> dict[str, float]:
    """``agent_loop/trajectories_per_sample/{mean,max}`` over the samples (episodes) of the batch,
    from the episode columns (rows whose ``trajectory_index`` is 0 each start one episode)."""
    index, count = (
        output.non_tensor_batch.get("trajectory_index"),
        output.non_tensor_batch.get("num_trajectories"),
    )
    if index is None or count is None:
        return {}
    if index.dtype.kind in "iu" and count.dtype.kind in "iu":  # as postprocess builds them
        firsts = count[index == 0]
        if not len(firsts):
            return {}
        return {"agent_loop/trajectories_per_sample/mean": float(firsts.mean()),
                "agent_loop/trajectories_per_sample/max": float(firsts.max())}
    per_sample = [  # object columns: None where no trajectory was rolled out
        int(n)
        for i, n in zip(index.tolist(), count.tolist(), strict=True)
        if i == 0 and n is not None
    ]
    if not per_sample:
        return {}
    return {"agent_loop/trajectories_per_sample/mean": float(np.mean(per_sample)),
            "agent_loop/trajectories_per_sample/max": float(max(per_sample))}
