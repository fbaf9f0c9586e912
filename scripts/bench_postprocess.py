"""postprocess at scale: agentloop's batched padding vs verl's per-sample path, in one process.

Input: ``--batch`` (1,024) AgentLoopOutputs, prompts up to ``--prompt-length`` (1k) and responses up
to ``--response-length`` (7k) tokens (lengths uniform between a quarter and all of the width, 1 in
64 responses empty, 1 in 16 over-long and truncated), with per-token log-probs and a reward score;
ids, masks and log-probs are Python lists, as the agent loops produce them.  Three paths are timed,
alternating, ``--repeats`` times:

* ``verl``: verl 0.9.1's per-sample path, re-implemented here from its code (its module does not
  import without verl's dependencies, e.g. codetiming): each sample's prompt, response and mask
  padded by ``tokenizer.pad(..., return_tensors="pt")`` (the tiny model's tokenizer), its log-probs
  by list concatenation into ``torch.tensor``, attention mask and ``input_ids`` by ``torch.cat``,
  position ids by ``clip(cumsum(mask) - 1)``; then every column ``torch.cat``-ed over the batch,
  ``rm_scores`` scattered, and a TensorDict built.
* ``old``: agentloop's previous ``postprocess`` tensor step (kept below: flatten each column with
  ``np.fromiter``, scatter through a boolean mask, int64 temporaries for masks and positions).
* ``new``: :func:`agentloop.batch.postprocess.postprocess` as shipped.

Reported per path: wall seconds (alternating passes in one process) and peak RSS above the RSS just
before the call (sampled every 2 ms, each pass in a child forked before any timed pass, so no path
reuses memory another freed); the script re-executes itself with a fixed glibc mmap threshold so
large arrays are mapped afresh. Before timing, old and new must give verl's tensors (``rm_scores``
compared by row sums: verl puts an empty response's score in the last column, agentloop in column
0).

    python scripts/bench_postprocess.py [--batch 1024] [--prompt-length 1024] [--response-length
    7168] [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import psutil
import torch
from tensordict import TensorDict

import agentloop.batch.postprocess as pp
from agentloop.rewards.columns import reward_columns
from agentloop.types import AgentLoopOutput

TOKENIZER = os.path.expanduser("~/.cache/agentloop/models/tiny-qwen2")


def make_outputs(
    batch: int, prompt_length: int, response_length: int, seed: int = 0
) -> list[AgentLoopOutput]:
    rng = random.Random(seed)
    outputs = []
    for i in range(batch):
        n_prompt = rng.randint(prompt_length // 4, prompt_length)
        n_resp = 0 if i % 64 == 5 else rng.randint(response_length // 4, response_length)
        if i % 16 == 3:
            n_prompt, n_resp = prompt_length + 7, response_length + 9
        ids = [rng.randrange(2048) for _ in range(n_resp)]
        mask = [1 if (j // 50) % 4 else 0 for j in range(n_resp)]
        logprobs = [-rng.random() * m for m in mask]
        outputs.append(
            AgentLoopOutput.model_construct(
                prompt_ids=[rng.randrange(2048) for _ in range(n_prompt)], response_ids=ids,
                response_mask=mask, response_logprobs=logprobs, reward_score=rng.random(),
                num_turns=3,
            )
        )
    return outputs


# -- baseline 1: verl's per-sample path (our re-implementation of what verl 0.9.1 does)
# -------------------------

def _pad_one(
    tokenizer: Any, ids: list[int], width: int, side: str, attention: bool
) -> dict[str, torch.Tensor]:
    if not ids:
        out = {"input_ids": torch.full((1, width), tokenizer.pad_token_id or 0, dtype=torch.long)}
        if attention:
            out["attention_mask"] = torch.zeros((1, width), dtype=torch.long)
        return out
    tokenizer.padding_side = side
    out = tokenizer.pad(
        {"input_ids": ids}, padding="max_length", max_length=width, return_tensors="pt",
        return_attention_mask=attention,
    )
    if out["input_ids"].dim() == 1:
        out = {k: v.unsqueeze(0) for k, v in out.items()}
    return out


def verl_path(
    tokenizer: Any, outputs: list[AgentLoopOutput], prompt_length: int, response_length: int
) -> TensorDict:
    rows: dict[str, list[torch.Tensor]] = {
        k: []
        for k in (
            "prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids",
            "rollout_log_probs",
        )
    }
    for o in outputs:  # verl truncates in the agent loop, before padding
        prompt = _pad_one(tokenizer, o.prompt_ids[-prompt_length:], prompt_length, "left", True)
        response = _pad_one(
            tokenizer, o.response_ids[:response_length], response_length, "right", True
        )
        mask = _pad_one(
            tokenizer, o.response_mask[:response_length], response_length, "right", False
        )
        logprobs = o.response_logprobs[:response_length]
        rows["rollout_log_probs"].append(
            torch.tensor(logprobs + [0.0] * (response_length - len(logprobs))).unsqueeze(0)
        )
        attention = torch.cat([prompt["attention_mask"], response["attention_mask"]], dim=1)
        rows["prompts"].append(prompt["input_ids"])
        rows["responses"].append(response["input_ids"])
        rows["response_mask"].append(mask["input_ids"] * response["attention_mask"])
        rows["attention_mask"].append(attention)
        rows["input_ids"].append(torch.cat([prompt["input_ids"], response["input_ids"]], dim=1))
        rows["position_ids"].append(torch.clip(torch.cumsum(attention, dim=-1) - 1, min=0))
    batch = {k: torch.cat(v, dim=0) for k, v in rows.items()}
    response_lengths = batch["attention_mask"][:, prompt_length:].sum(dim=1) - 1
    scores = torch.zeros_like(batch["response_mask"], dtype=torch.float32)
    scores[torch.arange(len(outputs)), response_lengths] = torch.tensor(
        [o.reward_score for o in outputs], dtype=torch.float32
    )
    batch["rm_scores"] = scores
    return TensorDict(batch, batch_size=len(outputs))


# -- baseline 2: agentloop's previous tensor step
# -----------------------------------------------------------------

def old_pad_rows(
    rows: Sequence[Sequence[Any]], width: int, fill: float, dtype: Any, *, left: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    keep = np.minimum(lens, width)
    cols = np.arange(width)
    valid = cols[None, :] >= (width - keep)[:, None] if left else cols[None, :] < keep[:, None]
    out = np.full((len(rows), width), fill, dtype=dtype)
    flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=dtype, count=int(lens.sum()))
    first = np.cumsum(lens) - lens + (lens - keep if left else 0)
    dest_start = np.cumsum(keep) - keep
    src = np.repeat(first - dest_start, keep) + np.arange(int(keep.sum()))
    out[valid] = flat[src]
    return out, valid


def old_tensor_columns(
    outputs: list[AgentLoopOutput], prompt_length: int, response_length: int, pad_token_id: int,
    calculate_log_probs: bool, rewards_configured: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    prompts, prompt_valid = old_pad_rows(
        [o.prompt_ids for o in outputs], prompt_length, pad_token_id, np.int64, left=True
    )
    responses, resp_valid = old_pad_rows(
        [o.response_ids for o in outputs], response_length, pad_token_id, np.int64
    )
    resp_mask, _ = old_pad_rows([o.response_mask for o in outputs], response_length, 0, np.int64)
    attention = np.concatenate([prompt_valid, resp_valid], axis=1).astype(np.int64)
    cols = {"prompts": prompts, "responses": responses, "response_mask": resp_mask * resp_valid,
            "input_ids": np.concatenate([prompts, responses], axis=1), "attention_mask": attention,
            "position_ids": np.clip(np.cumsum(attention, axis=1) - 1, 0, None)}
    if calculate_log_probs:
        logprobs = [o.response_logprobs if o.response_logprobs is not None else () for o in outputs]
        cols["rollout_log_probs"], _ = old_pad_rows(logprobs, response_length, 0.0, np.float32)
    reward: dict[str, np.ndarray] = {}
    if rewards_configured or any(o.reward_score is not None for o in outputs):
        tensors, reward = reward_columns(outputs, resp_valid)
        cols.update(tensors)
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in cols.items()}, reward


def agentloop_path(
    outputs: list[AgentLoopOutput], prompt_length: int, response_length: int, old: bool
) -> Any:
    new_columns = pp._tensor_columns
    if old:
        pp._tensor_columns = old_tensor_columns  # type: ignore[assignment]
    try:
        return pp.postprocess(
            outputs, prompt_length=prompt_length, response_length=response_length, pad_token_id=0,
            calculate_log_probs=True,
        )
    finally:
        pp._tensor_columns = new_columns  # type: ignore[assignment]


# -- measurement
# --------------------------------------------------------------------------------------------------

def seconds(fn: Callable[[], Any]) -> float:
    """Wall seconds of one call; its result is freed before returning."""
    gc.collect()
    start = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - start
    del result
    return elapsed


def peak_rss_fresh(fn: Callable[[], Any]) -> float:
    """Peak RSS above the starting RSS, in MiB, of one call in a forked child (RSS sampled every 2
    ms).

    In one long process, freed blocks of earlier passes (verl's per-sample tensors above all) are
    reused by later ones, so each path's memory is measured in a child forked before any pass has
    run."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: measure, report, exit without running the parent's cleanup
        os.close(read)
        proc = psutil.Process()
        base = proc.memory_info().rss
        peak = [base]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.002):
                peak[0] = max(peak[0], proc.memory_info().rss)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        result = fn()
        peak[0] = max(peak[0], proc.memory_info().rss)
        stop.set()
        sampler.join()
        del result
        os.write(write, str((peak[0] - base) / 2**20).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        value = float(pipe.read())
    os.waitpid(pid, 0)
    return value


def check_equal(
    outputs: list[AgentLoopOutput], prompt_length: int, response_length: int, tokenizer: Any
) -> None:
    old = agentloop_path(outputs, prompt_length, response_length, old=True).batch
    new = agentloop_path(outputs, prompt_length, response_length, old=False).batch
    verl = verl_path(tokenizer, outputs, prompt_length, response_length)
    for key in list(verl.keys()):  # iterating a TensorDict walks its rows
        for name, batch in (("old", old), ("new", new)):
            mine, theirs = batch[key], verl[key]
            # verl puts an empty response's score in the last column, agentloop in column 0
            if key == "rm_scores":
                mine, theirs = mine.sum(-1), theirs.sum(-1)
            if mine.dtype != theirs.dtype or not torch.equal(mine, theirs):
                raise SystemExit(f"{name} postprocess differs from the verl path on {key!r}")


def main() -> None:
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # A fixed mmap threshold: every large array is mapped fresh and unmapped when freed, as in a
        # long-running
        # trainer, so page faults and RSS measure each pass alone (glibc otherwise recycles earlier
        # passes' heap).
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072",
               "TOKENIZERS_PARALLELISM": "false"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--prompt-length", type=int, default=1024)
    parser.add_argument("--response-length", type=int, default=7168)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory-repeats", type=int, default=2)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from agentloop.testing.tiny_model import ensure_tiny_model

    ensure_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    outputs = make_outputs(args.batch, args.prompt_length, args.response_length)
    tokens = sum(
        min(len(o.prompt_ids), args.prompt_length) + min(len(o.response_ids), args.response_length)
        for o in outputs
    )
    paths: dict[str, Callable[[], Any]] = {
        "verl per-sample": lambda: verl_path(
            tokenizer, outputs, args.prompt_length, args.response_length
        ),
        "agentloop old": lambda: agentloop_path(
            outputs, args.prompt_length, args.response_length, old=True
        ),
        "agentloop new": lambda: agentloop_path(
            outputs, args.prompt_length, args.response_length, old=False
        ),
    }
    memory = {
        name: [peak_rss_fresh(fn) for _ in range(args.memory_repeats)] for name, fn in paths.items()
    }
    check_equal(outputs[:64], args.prompt_length, args.response_length, tokenizer)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.repeats):
        for name, fn in paths.items():
            times[name].append(seconds(fn))
        print(".", end="", flush=True)
    print(
        f"\npostprocess of {args.batch} x ({args.prompt_length} + {args.response_length}) "
        f"tokens ({tokens:,} real), "
        f"log-probs and rewards; seconds: {args.repeats} alternating passes in one "
        f"process; peak extra RSS: "
        f"{args.memory_repeats} passes each in a fresh fork; median (min-max)\n"
    )
    print("| path | seconds | peak extra RSS MiB | verl / path (medians) | (minimums) |")
    print("| --- | --- | --- | --- | --- |")
    verl = times["verl per-sample"]
    for name in paths:
        t, m = times[name], memory[name]
        print(
            f"| {name} | {statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f}) | "
            f"{statistics.median(m):.0f} "
            f"({min(m):.0f}-{max(m):.0f}) | "
            f"{statistics.median(verl) / statistics.median(t):.1f}x | "
            f"{min(verl) / min(t):.1f}x |"
        )

if __name__ == "__main__":
    main()
