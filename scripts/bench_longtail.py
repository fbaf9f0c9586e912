"""Long-tail rollout on the real engine: verl-style synchronous batches vs agentloop's tail-aware
modes, one run.

The heavy-tailed agentic shape of the rollout simulator (docs/routing.md) on vLLM CPU with the tiny
model and ``--servers`` engines: per sample a lognormal number of turns (median ``--turns``, sigma
``--turn-sigma``), each an ``ignore_eos`` generation of lognormal ``max_tokens`` (median
``--median-tokens``, sigma ``--sigma``), and a sleeping tool between turns (lognormal, median
``--tool-latency`` s).  Engines run vLLM's priority scheduler with ``--max-num-seqs`` running
requests each, so a server queues when more samples are in flight than it runs.

Passes (alternating, ``--repeats`` rounds, the same batches each time):

* ``verl``: ``manager.generate_sequences`` per batch, sticky least-in-flight routing, no priority
  sent (every request 0 = arrival order): verl's AgentLoopManager step, the batch ends with its
  slowest sample;
* ``priority``: the same with ``rollout.server.priority: context`` (longer contexts first);
* ``rollouter``: a :class:`~agentloop.rollout.rollouter.Rollouter` over the same batches with the
  in-flight budget of one batch and context priority; each step takes the first ``--groups`` groups
  to finish, the rest carry over;
* with ``--updates``, three more Rollouter passes that load the weights (the same values) into every
  server with ``manager.update_weights`` after each step, as a trainer does, under each
  ``rollout.server.weight_update``: ``abort`` (the default: running requests are cut and resumed,
  re-reading their contexts), ``drain`` (running requests finish first, new ones wait) and ``keep``
  (running requests are frozen and go on with their KV cache).
* with ``--per-group``, the ``rollouter`` and ``abort`` passes once more with the Rollouter's
  ``per_sample=False`` (``rollout-g``, ``abort-g``: a group holds its places in the in-flight budget
  until its last sample ends; the only way before 2026-11-27).

Prints seconds per step (median, range) of each and the ratio verl / each; for Rollouter passes,
the groups handed out per staleness (weight versions behind when handed out); per pass kind the
engines' own prefix-cache hit rate: the prompt tokens vLLM found in its prefix cache
(``RequestOutput.num_cached_tokens``, in each output's ``extra_fields``) / the prompt tokens sent,
summed over every generate call of the timed passes (every pass starts with the engines' prefix
caches cleared, so no pass reuses what an earlier one left).  ``--system-tokens K`` puts the same K
token ids before every prompt (a shared system prompt); ``--prompt-tokens K`` K more ids of each
group's own (its question and context, shared by its ``--n`` samples only: the GRPO siblings'
prefix).  vLLM CPU caches whole blocks of 128 tokens.

    python scripts/bench_longtail.py [--servers 2] [--groups 8] [--n 4] [--steps 3] [--repeats 2]
    [--updates] [--per-group] [--max-staleness K] [--routing sticky|prefix] [--system-tokens K]
    [--prompt-tokens K]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
from omegaconf import OmegaConf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_async  # noqa: E402  (TailLoop, make_batches, the passes)


def tiny_weights(path: str) -> dict:
    """The served model's own weights (an update that changes nothing but costs what a real one
    does)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def system_ids(k: int) -> list[int]:
    """``k`` fixed token ids of the tiny model's vocabulary (2,048): the shared system prompt."""
    return [100 + (7 * i) % 1800 for i in range(k)]


def group_ids(k: int, key: int) -> list[int]:
    """``k`` token ids of one group's own (drawn with seed ``key``; distinct per group)."""
    return [int(t) for t in np.random.default_rng(key).integers(100, 1900, k)]


def add_prefixes(batches: list[Any], n: int, system_tokens: int, prompt_tokens: int) -> None:
    """Put ``system_tokens`` shared ids and ``prompt_tokens`` ids of its group's own in every row's
    ``extra_info["system_ids"]`` (rows: groups of ``n`` adjacent samples)."""
    shared = system_ids(system_tokens)
    key = 0
    for batch in batches:
        for i, info in enumerate(batch.non_tensor_batch["extra_info"]):
            info["system_ids"] = shared + group_ids(prompt_tokens, key + i // n)
        key += len(batch) // n


def cache_tally(parts: list[Any]) -> tuple[int, int] | None:
    """(cached, sent): the engine's prefix-cache hits and the prompt tokens sent, summed over the
    rows of ``parts`` (outputs of ``bench_async.TailLoop``: its ``cached_tokens`` and
    ``prompt_tokens_sent`` columns); None when a row has no cached count (the engine did not say).
    """
    cached = sent = 0
    for part in parts:
        cols = part.non_tensor_batch
        if "cached_tokens" not in cols:
            return None
        for c, n in zip(cols["cached_tokens"], cols["prompt_tokens_sent"], strict=True):
            if c is None:
                return None
            cached, sent = cached + int(c), sent + int(n)
    return cached, sent


def hit_rate(tallies: list[tuple[int, int] | None]) -> str:
    """sum(cached) / sum(sent) over ``tallies`` as a percentage with the sums ("n/a" if one is
    None or nothing was sent)."""
    if not tallies or any(t is None for t in tallies):
        return "n/a"
    sent = sum(t[1] for t in tallies if t is not None)
    cached = sum(t[0] for t in tallies if t is not None)
    return f"{100.0 * cached / sent:.1f}% ({cached}/{sent})" if sent else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--turn-sigma", type=float, default=0.8)
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--median-tokens", type=float, default=24)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--tool-latency", type=float, default=0.3)
    parser.add_argument("--tool-sigma", type=float, default=1.0)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument(
        "--routing", choices=["sticky", "prefix"], default="sticky",
        help="rollout.server.routing for every pass (prefix: KV-cache-aware, docs/routing.md)",
    )
    parser.add_argument(
        "--system-tokens", type=int, default=0,
        help="the same K token ids before every prompt (a shared system prompt)",
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=0,
        help="K token ids of each group's own after them (shared by its n samples only)",
    )
    parser.add_argument(
        "--updates", action="store_true",
        help="also Rollouter passes with a weight update per step: drain, abort, keep",
    )
    parser.add_argument(
        "--per-group", action="store_true",
        help="also the rollouter (and abort) passes with per_sample=False: rollout-g, abort-g",
    )
    parser.add_argument(
        "--max-staleness", type=int, default=None,
        help="the Rollouter passes' max_staleness (default: unbounded)",
    )
    args = parser.parse_args()
    print(
        "workload: "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in sorted(vars(args).items())),
        flush=True,
    )

    import ray
    import ray.cloudpickle

    from agentloop.config import default_config
    from agentloop.loops.base import register
    from agentloop.rollout.manager import AgentLoopManager
    from agentloop.testing.tiny_model import ensure_tiny_model

    register("bench_tail")(bench_async.TailLoop)
    ray.cloudpickle.register_pickle_by_value(bench_async)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(include_dashboard=False, logging_level="ERROR")
    cfg = default_config()
    for k, v in {
        "actor_rollout_ref.model.path": str(ensure_tiny_model()),
        "data.max_prompt_length": 128 + args.system_tokens + args.prompt_tokens,
        "data.max_response_length": args.max_turns
        * (args.max_tokens + len(bench_async.TOOL_TOKENS)),
        "actor_rollout_ref.rollout.dtype": "float32",
        "actor_rollout_ref.rollout.free_cache_engine": False,
        "actor_rollout_ref.rollout.max_num_seqs": args.max_num_seqs,
        "actor_rollout_ref.rollout.agent.num_workers": 2,
        "actor_rollout_ref.rollout.server.num_servers": args.servers,
        "actor_rollout_ref.rollout.server.routing": args.routing,
        "actor_rollout_ref.rollout.server.device": "cpu",
        # engines in priority mode; the verl pass sends none
        "actor_rollout_ref.rollout.server.priority": "context",
    }.items():
        OmegaConf.update(cfg, k, v)
    manager = AgentLoopManager(cfg)
    try:
        batches = bench_async.make_batches(args, seed=0)
        add_prefixes(batches, args.n, args.system_tokens, args.prompt_tokens)
        rows_per_step = args.groups * args.n
        bench_async.sync_pass(manager, batches[:1])  # warm-up
        per_step: dict[str, list[float]] = {"verl": [], "priority": [], "rollouter": []}
        if args.per_group:
            per_step["rollout-g"] = []
        if args.updates:
            per_step.update({"drain": [], "abort": [], "keep": []})
            if args.per_group:
                per_step["abort-g"] = []
            weights = tiny_weights(str(cfg.actor_rollout_ref.model.path))
        tallies: dict[str, list[tuple[int, int] | None]] = {m: [] for m in per_step}
        for r in range(args.repeats):
            for mode in per_step:
                manager.workers.broadcast("set_priority", None if mode == "verl" else "context")
                manager.set_weight_update(mode if mode in ("drain", "keep") else "abort")
                manager.clear_kv_cache()  # each pass starts cold: hits are its own
                time.sleep(1.5)  # let idle engine threads settle
                per_sample = not mode.endswith("-g")
                metrics: dict = {}
                parts: list[Any] = []
                if mode in ("drain", "abort", "keep", "abort-g"):
                    # under the mode set above
                    step = functools.partial(manager.update_weights, weights)
                    wall, rows, _ = bench_async.async_pass(
                        manager, batches, args.groups, rows_per_step, step, per_sample, metrics,
                        args.max_staleness, parts,
                    )
                elif mode in ("rollouter", "rollout-g"):
                    wall, rows, _ = bench_async.async_pass(
                        manager, batches, args.groups, rows_per_step, per_sample=per_sample,
                        metrics=metrics, max_staleness=args.max_staleness, outputs=parts,
                    )
                else:
                    wall, rows = bench_async.sync_pass(manager, batches, parts)
                per_step[mode].append(wall / (rows / rows_per_step))
                tallies[mode].append(cache_tally(parts))
                # groups handed out per staleness (weight versions behind)
                stale = metrics.get("rollouter/staleness")
                rerun = metrics.get("rollouter/groups_rerun_stale")
                print(
                    f"round {r} {mode:9s}: {rows} trajectories in {wall:.1f}s = "
                    f"{per_step[mode][-1]:.2f}s per step; engine prefix-cache hits "
                    f"{hit_rate(tallies[mode][-1:])}"
                    + (f"; staleness {stale}, re-run {rerun}" if stale is not None else ""),
                    flush=True,
                )
        med = {m: statistics.median(v) for m, v in per_step.items()}
        for mode, values in per_step.items():
            print(
                f"{mode:9s}: {med[mode]:.2f}s per step (range "
                f"{min(values):.2f}-{max(values):.2f}); "
                f"verl / {mode} = {med['verl'] / med[mode]:.2f}x; "
                f"engine prefix-cache hits {hit_rate(tallies[mode])}"
            )
    finally:
        manager.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
