"""Synchronous batches vs asynchronous streaming (Rollouter) on a heavy-tailed agentic workload, in
one run.

Workload (the same samples for both modes): each sample runs a number of generations (``--turns``;
with ``--turn-sigma`` > 0 drawn per sample from a lognormal with that median, clipped to
1..``--max-turns``) with ``ignore_eos`` and a per-turn ``max_tokens`` drawn from a lognormal (median
``--median-tokens``, sigma ``--sigma``), with "tool" time between turns (median ``--tool-latency``
seconds; lognormal with ``--tool-sigma``, 0 = fixed) and a short tool message — a long tail of slow
samples, as in agentic RL.  One vLLM CPU server, the tiny model. ``--agentic`` is the preset of the
measured table in docs/benchmarks.md (variable turns and tool times).

* sync: ``--steps`` calls of ``manager.generate_sequences`` on ``--groups`` groups of ``--n``
  samples each (the next batch starts when the slowest sample of the previous one ends);
* async: a :class:`agentloop.rollout.rollouter.Rollouter` over the same batches with the same
  in-flight budget (``groups * n`` samples), the consumer taking ``--groups`` complete groups per
  step.

Passes alternate (sync, async, sync, async, ...) so drift hits both alike; prints trajectories/s of
each, the ratio async / sync (goal >= 1.5), and the engine's busy fraction (seconds with at least
one request in the engine / wall).  ``--tool-heavy``: tools 10x slower than a turn's decode and 4x
the in-flight budget for the async mode (``--inflight-factor``; goal: engine busy >= 90%).

    python scripts/bench_async.py [--groups 8] [--n 4] [--steps 4] [--repeats 2] [--agentic]
    [--tool-heavy]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from agentloop.loops.base import AgentLoopBase, register
from agentloop.types import AgentLoopOutput

TOOL_TOKENS = [11, 12, 13, 14, 15]


class TailLoop(AgentLoopBase):
    """``extra_info["turn_tokens"]`` generations (ignore_eos), ``extra_info["tool_latency"][k]``
    s after turn k; ``extra_info["system_ids"]`` (optional) before the rendered prompt.  Extra
    fields: ``prompt_tokens_sent`` (the prompt tokens of every generate call) and
    ``cached_tokens`` (the engine's prefix-cache hits among them; None when an output lacks
    ``num_cached_tokens``)."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        info = kwargs["extra_info"]
        ids = [int(t) for t in info.get("system_ids") or []] + [
            int(t)
            for t in self.tokenizer.apply_chat_template(
                list(kwargs["raw_prompt"]), add_generation_prompt=True, tokenize=True,
                return_dict=False,
            )
        ]
        prompt_len, mask, rid = len(ids), [], uuid.uuid4().hex
        turns = list(info["turn_tokens"])
        versions: list[int] = []
        decode: list[float] = []
        sent, cached = 0, []
        for k, max_tokens in enumerate(turns):
            t0 = time.perf_counter()
            sent += len(ids)
            out = await self.server_manager.generate(
                request_id=rid,
                prompt_ids=ids,
                sampling_params={
                    **sampling_params, "max_tokens": int(max_tokens), "ignore_eos": True,
                },
            )
            decode.append(time.perf_counter() - t0)
            ids += out.token_ids
            mask += [1] * len(out.token_ids)
            versions.append(int(out.extra_fields.get("global_steps", 0)))
            cached.append(out.extra_fields.get("num_cached_tokens"))
            if k < len(turns) - 1:
                await asyncio.sleep(float(info["tool_latency"][k]))
                ids += TOOL_TOKENS
                mask += [0] * len(TOOL_TOKENS)
        return AgentLoopOutput(
            prompt_ids=ids[:prompt_len],
            response_ids=ids[prompt_len:],
            response_mask=mask,
            num_turns=2 * len(turns),
            extra_fields={
                "min_global_steps": min(versions), "max_global_steps": max(versions),
                "decode_s": float(np.mean(decode)), "prompt_tokens_sent": sent,
                "cached_tokens": None if None in cached else sum(cached),
            },
        )


def make_batches(args: argparse.Namespace, seed: int) -> list[Any]:
    from agentloop.batch.data import repeat_for_rollout, rows_to_batch

    rng = np.random.default_rng(seed)
    batches = []
    for step in range(args.steps):
        rows = [
            {
                "prompt": [
                    {"role": "user", "content": f"Step {step}, question {g}: tell me a story."}
                ],
                "agent_name": "bench_tail",
                "extra_info": {},
            }
            for g in range(args.groups)
        ]
        batch = repeat_for_rollout(rows_to_batch(rows), args.n)
        infos = []
        for _ in range(len(batch)):
            turns = (
                args.turns
                if not args.turn_sigma
                else int(
                    np.clip(
                        round(rng.lognormal(np.log(args.turns), args.turn_sigma)), 1, args.max_turns
                    )
                )
            )
            tokens = np.clip(
                rng.lognormal(np.log(args.median_tokens), args.sigma, turns), 4, args.max_tokens
            )
            tools = (
                rng.lognormal(np.log(args.tool_latency), args.tool_sigma, turns)
                if args.tool_sigma
                else np.full(turns, args.tool_latency)
            )
            infos.append(
                {"turn_tokens": [int(t) for t in tokens], "tool_latency": [float(t) for t in tools]}
            )
        batch.non_tensor_batch["extra_info"] = np.array(infos, dtype=object)
        batches.append(batch)
    return batches


def engine_busy_seconds(manager: Any) -> float:
    return float(np.mean(manager.engine_busy_seconds()))


def sync_pass(
    manager: Any, batches: list[Any], outputs: list[Any] | None = None
) -> tuple[float, int]:
    """Returns (wall, rows); ``outputs`` (optional) gets each batch's output."""
    t0 = time.perf_counter()
    rows = 0
    for b in batches:
        out = manager.generate_sequences(b)
        rows += len(out)
        if outputs is not None:
            outputs.append(out)
    return time.perf_counter() - t0, rows


def async_pass(manager: Any, batches: list[Any], groups: int, inflight: int,
               after_get: Any = None, per_sample: bool = True,
               metrics: dict[str, Any] | None = None,
               max_staleness: int | None = None,
               outputs: list[Any] | None = None) -> tuple[float, int, float]:
    """Returns (wall, rows, engine busy fraction while the in-flight budget was full).
    ``after_get()`` runs after each hand-out (a trainer step, e.g. a weight update);
    ``per_sample``: the Rollouter's (False: a group holds its places until its last sample ends);
    ``metrics``: filled with the Rollouter's final :meth:`~Rollouter.metrics`; ``max_staleness``:
    the Rollouter's; ``outputs``: gets each hand-out."""
    import threading

    from agentloop.rollout.rollouter import Rollouter

    t0 = time.perf_counter()
    rollouter = Rollouter(
        manager, iter(batches), max_inflight=inflight, groups_per_dispatch=1,
        per_sample=per_sample, max_staleness=max_staleness,
    ).start()
    samples: list[tuple[float, float, int]] = []  # (time, busy seconds, samples in flight)
    done = threading.Event()

    def monitor() -> None:  # the engine's busy clock while the rollouter had its budget in flight
        while not done.wait(0.25):
            samples.append(
                (time.perf_counter(), engine_busy_seconds(manager), rollouter._inflight())
            )

    watcher = threading.Thread(target=monitor, daemon=True)
    watcher.start()
    rows = 0
    while (part := rollouter.get(num_groups=groups)) is not None:
        rows += len(part)
        if outputs is not None:
            outputs.append(part)
        if after_get is not None:
            after_get()
    wall = time.perf_counter() - t0
    done.set()
    watcher.join()
    if metrics is not None:
        metrics.update(rollouter.metrics())
    rollouter.stop()
    full = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(samples, samples[1:], strict=False)
            if min(a[2], b[2]) >= 0.9 * inflight]
    saturated = sum(busy for _, busy in full) / sum(t for t, _ in full) if full else float("nan")
    return wall, rows, saturated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--median-tokens", type=float, default=16)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--tool-latency", type=float, default=0.2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--turn-sigma", type=float, default=0.0)
    parser.add_argument("--max-turns", type=int, default=12)
    parser.add_argument("--tool-sigma", type=float, default=0.0)
    parser.add_argument(
        "--agentic", action="store_true",
        help="preset: --turns 3 --turn-sigma 0.7 --tool-latency 0.3 --tool-sigma 1.0",
    )
    parser.add_argument("--tool-heavy", action="store_true")
    parser.add_argument(
        "--inflight-factor", type=int, default=None,
        help="async in-flight budget = this x groups x n (default 1; 4 with --tool-heavy)",
    )
    args = parser.parse_args()
    if args.agentic:
        args.turns, args.turn_sigma, args.tool_latency, args.tool_sigma = 3, 0.7, 0.3, 1.0
    print(
        "workload: "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in sorted(vars(args).items())
            if not isinstance(v, bool)
        ),
        flush=True,
    )

    import ray
    import ray.cloudpickle

    from agentloop.config import default_config
    from agentloop.rollout.manager import AgentLoopManager
    from agentloop.testing.tiny_model import ensure_tiny_model

    max_turns = args.max_turns if args.turn_sigma else args.turns
    register("bench_tail")(TailLoop)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(include_dashboard=False, logging_level="ERROR")
    cfg = default_config()
    for k, v in {
        "actor_rollout_ref.model.path": str(ensure_tiny_model()), "data.max_prompt_length": 128,
        "data.max_response_length": max_turns * (args.max_tokens + len(TOOL_TOKENS)),
        "actor_rollout_ref.rollout.dtype": "float32",
        "actor_rollout_ref.rollout.free_cache_engine": False,
        "actor_rollout_ref.rollout.max_num_seqs": 256,
        "actor_rollout_ref.rollout.agent.num_workers": 2,
        "actor_rollout_ref.rollout.server.num_servers": 1,
        "actor_rollout_ref.rollout.server.device": "cpu",
    }.items():
        OmegaConf.update(cfg, k, v)
    manager = AgentLoopManager(cfg)
    try:
        budget = args.groups * args.n
        factor = args.inflight_factor or (4 if args.tool_heavy else 1)
        if args.tool_heavy:  # calibrate: a turn's decode time, then tools 10x slower
            probe = make_batches(
                argparse.Namespace(**{**vars(args), "steps": 1, "turns": 1, "turn_sigma": 0}),
                seed=99,
            )[0]
            out = manager.generate_sequences(probe)
            turn = float(np.median(out.non_tensor_batch["decode_s"].astype(float)))
            args.tool_latency = 10 * turn
            print(f"tool-heavy: a turn's decode takes {turn:.3f}s (median), tool latency set to "
                  f"{args.tool_latency:.2f}s", flush=True)
        batches = make_batches(args, seed=0)
        sync_pass(manager, batches[:1])  # warm-up
        results: dict[str, list[float]] = {"sync": [], "async": []}
        busy: dict[str, list[float]] = {"sync": [], "async": []}
        full: list[float] = []
        for r in range(args.repeats):
            for mode in ("sync", "async"):
                time.sleep(1.5)  # let idle engine threads settle
                b0 = engine_busy_seconds(manager)
                saturated = float("nan")
                if mode == "sync":
                    wall, rows = sync_pass(manager, batches)
                else:
                    wall, rows, saturated = async_pass(
                        manager, batches, args.groups, budget * factor
                    )
                    full.append(saturated)
                results[mode].append(rows / wall)
                busy[mode].append((engine_busy_seconds(manager) - b0) / wall)
                print(
                    f"pass {r} {mode:5s}: {rows} trajectories in {wall:.2f}s = "
                    f"{rows / wall:.2f}/s, "
                    f"engine busy {busy[mode][-1]:.0%}"
                    + (
                        f" ({saturated:.0%} while {budget * factor} samples were in flight)"
                        if mode == "async"
                        else ""
                    ),
                    flush=True,
                )
        med = {m: statistics.median(v) for m, v in results.items()}
        spread = {m: (min(v), max(v)) for m, v in results.items()}
        print(
            f"sync : {med['sync']:.2f} trajectories/s (range "
            f"{spread['sync'][0]:.2f}-{spread['sync'][1]:.2f}), "
            f"engine busy {statistics.median(busy['sync']):.0%}"
        )
        print(
            f"async: {med['async']:.2f} trajectories/s (range "
            f"{spread['async'][0]:.2f}-{spread['async'][1]:.2f}), "
            f"engine busy {statistics.median(busy['async']):.0%}, "
            f"{statistics.median(full):.0%} while its in-flight budget was full"
        )
        print(f"ratio async / sync: {med['async'] / med['sync']:.2f}x")
    finally:
        manager.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
