"""Overhead of the agentloop stack over the raw engine, measured in one run.

The same requests (``--num-prompts`` chat prompts, exactly ``--max-tokens`` new tokens each, EOS
ignored) go (a) straight into a vLLM ``AsyncLLM`` in this process and (b) through
``AgentLoopManager.generate_sequences`` with one server actor built from the same engine settings.
All engines stay up for the whole run; after two full-size warm-up passes each, ``--repeats`` timed
passes alternate between the paths (raw, agentloop, raw, ...) so drift of the machine hits both
alike.  Each agentloop pass gets prompts it has not seen (a trainer's next step), ``--n`` rows per
prompt. Prints both throughputs and the ratio agentloop / raw (goal: >= 0.97).

    python scripts/bench_overhead.py [--num-prompts 256] [--max-tokens 64] [--repeats 7] [--n 1]
    [--num-workers 1]
                                     [--compare-unbatched] [--compare-channel]
    python scripts/bench_overhead.py --device cuda     # on a GPU: the CUDA build of vLLM, bfloat16,
    CUDA graphs

On CUDA both engines share the one GPU (``--gpu-memory-utilization`` each); the raw engine and the
server actor are built from the same ``engine_args``, so they compile and capture the same graphs.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import os
import statistics
import time
import uuid
from collections.abc import Callable

import numpy as np
from omegaconf import OmegaConf

IDLE_SETTLE_S = 1.5


def make_config(model_path: str, args: argparse.Namespace):
    from agentloop.config import default_config

    cfg = default_config()
    overrides = {
        "actor_rollout_ref.model.path": model_path, "data.max_prompt_length": 256,
        "data.max_response_length": args.max_tokens,
        "actor_rollout_ref.rollout.dtype": "float32" if args.device == "cpu" else "bfloat16",
        "actor_rollout_ref.rollout.ignore_eos": True,
        "actor_rollout_ref.rollout.free_cache_engine": False,
        "actor_rollout_ref.rollout.max_num_seqs": args.num_prompts,
        "actor_rollout_ref.rollout.agent.num_workers": args.num_workers,
        "actor_rollout_ref.rollout.server.num_servers": 1,
        "actor_rollout_ref.rollout.server.device": args.device,
        "actor_rollout_ref.rollout.server.num_cpus_per_server": 1,
    }
    if args.device == "cuda":
        overrides["actor_rollout_ref.rollout.gpu_memory_utilization"] = args.gpu_memory_utilization
    for k, v in overrides.items():
        OmegaConf.update(cfg, k, v)
    OmegaConf.resolve(cfg)
    return cfg


def make_batch(n: int, group: int = 1, step: int = 0):
    """``n`` rows: ``n / group`` distinct prompts, each ``group`` times in a row (GRPO's
    ``rollout.n``).  The prompts name the step, so every pass renders new text as a trainer's steps
    do (renders are cached)."""
    from agentloop.batch.data import rows_to_batch

    topics = ["the sea", "a cat", "numbers", "rain", "the moon", "bread", "a map", "music"]
    rows = [
        {
            "prompt": [
                {
                    "role": "user",
                    "content": f"Tell me about {topics[(i // group) % 8]} "
                    f"(#{i // group}, step {step}).",
                }
            ]
        }
        for i in range(n)
    ]
    return rows_to_batch(rows)


async def raw_pass(engine, prompts: list[list[int]], params) -> tuple[float, int]:
    from vllm.inputs import TokensPrompt

    async def one(ids: list[int]) -> int:
        final = None
        async for out in engine.generate(
            TokensPrompt(prompt_token_ids=ids), params, uuid.uuid4().hex
        ):
            final = out
        return len(final.outputs[0].token_ids)

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - t0, sum(counts)


class RawEngine:
    """The raw engine, driven from its own event loop so that its passes can alternate with
    agentloop's."""

    def __init__(self, cfg, prompts: Callable[[], list[list[int]]]) -> None:
        from vllm import SamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM

        from agentloop.cluster.placement import cpu_bind_env
        from agentloop.config import resolve_config
        from agentloop.servers.vllm import engine_args

        r = cfg.actor_rollout_ref.rollout
        on_cpu = r.server.device == "cpu"
        if on_cpu:
            os.environ.update(cpu_bind_env(0, 1))  # the same core binding the server actor gets
        self.prompts = prompts
        # the raw engine used at its best: no detokenizing, final output only
        self.params = SamplingParams(
            max_tokens=int(r.response_length), temperature=1.0, ignore_eos=True, detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        self.loop = asyncio.new_event_loop()

        async def build():
            typed = resolve_config(cfg)  # the sections the server actor builds from the same config
            args = engine_args(typed.engine, typed.server, typed.model_config, on_cpu)
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

        self.engine = self.loop.run_until_complete(build())

    def rate(self) -> float:
        # rendered before the clock starts: the raw engine is given token ids
        prompts = self.prompts()
        wall, tokens = self.loop.run_until_complete(raw_pass(self.engine, prompts, self.params))
        return tokens / wall

    def close(self) -> None:
        self.engine.shutdown()
        # The engine's output handler is still parked on its queue: cancel it inside the loop before
        # closing
        # (closing first makes it log "Event loop is closed" at exit).
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()
        del self.engine  # its __del__ shuts down again: let it run now, not at interpreter exit


class AgentLoopPath:
    """Passes through AgentLoopManager; also records the stack's serial time per pass: the whole
    call minus the longest engine wait any sample saw (rendering before the first request,
    postprocessing and transfers after the last result)."""

    def __init__(self, manager, num_prompts: int, group: int, via_ray: bool = False) -> None:
        self.manager, self.num_prompts, self.group = manager, num_prompts, group
        self.via_ray = via_ray
        """The rows come through Ray's stream (``agent.result_channel: ray``) in this path's
        passes: the manager's result channel is set aside for them."""
        self.serial_ms: list[float] = []
        self.after_ms: list[float] = []
        """Per pass: the part of the serial time after the batch's last sample finished (its rows
        padded, sent to the driver, concatenated, checked: ``agent_loop/serial/after_last_sample``).
        """
        self.step = 0

    def rate(self) -> float:
        self.step += 1
        batch = make_batch(self.num_prompts, self.group, self.step)
        channel = self.manager.workers.channel
        if self.via_ray:
            self.manager.workers.channel = None
        try:
            t0 = time.perf_counter()
            out = self.manager.generate_sequences(batch)
            wall = time.perf_counter() - t0
        finally:
            self.manager.workers.channel = channel
        timing = out.meta_info["timing"]
        self.serial_ms.append(1000 * (wall - timing["agent_loop/generate_sequences/max"]))
        after = timing.get("agent_loop/serial/after_last_sample")
        self.after_ms.append(float("nan") if after is None else 1000 * after)
        via = " (via Ray)" if self.via_ray else ""
        print(
            f"  agentloop{via} pass {self.step}: serial {self.serial_ms[-1]:.1f} ms = before the "
            f"first request and per-sample work {self.serial_ms[-1] - self.after_ms[-1]:.1f} ms "
            f"+ after the last sample {self.after_ms[-1]:.1f} ms", flush=True,
        )
        return float(out.batch["response_mask"].sum()) / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument(
        "--n",
        type=int,
        default=1,
        help="rows per distinct prompt (GRPO's rollout.n; the stack renders "
        "each distinct prompt once)",
    )
    parser.add_argument(
        "--compare-unbatched", action="store_true",
        help="also run with rollout.server.batch_calls=false (one Ray call per request)",
    )
    parser.add_argument(
        "--compare-channel", action="store_true",
        help="also run passes whose rows come through Ray's stream (agent.result_channel: ray) "
        "on the same manager and server, in turn with the others",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.3,
        help="per engine on CUDA (the raw engine and the server actor share the GPU)",
    )
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from agentloop.loops.prompt import apply_chat_template
    from agentloop.rollout.manager import AgentLoopManager
    from agentloop.testing.tiny_model import ensure_tiny_model
    from agentloop.tokenization.loader import load_tokenizer

    cfg = make_config(str(ensure_tiny_model()), args)
    tok = load_tokenizer(cfg.actor_rollout_ref.model)
    raw_steps = itertools.count(1)

    # the same shape as agentloop's passes: new text each pass
    def raw_prompts() -> list[list[int]]:
        messages = make_batch(args.num_prompts, args.n, next(raw_steps)).non_tensor_batch[
            "raw_prompt"
        ]
        return [apply_chat_template(tok, list(m), add_generation_prompt=True) for m in messages]

    raw = RawEngine(cfg, raw_prompts)
    ray.init(
        num_cpus=2 if args.device == "cpu" else None, include_dashboard=False, logging_level="ERROR"
    )
    ours_path = AgentLoopPath(AgentLoopManager(cfg), args.num_prompts, args.n)
    agentloop_paths = {"AgentLoopManager (1 srv)": ours_path}
    if args.compare_unbatched:
        unbatched_cfg = copy.deepcopy(cfg)
        OmegaConf.update(unbatched_cfg, "actor_rollout_ref.rollout.server.batch_calls", False)
        agentloop_paths["  … batch_calls=false"] = AgentLoopPath(
            AgentLoopManager(unbatched_cfg), args.num_prompts, args.n
        )
    if args.compare_channel:
        agentloop_paths["  … result_channel=ray"] = AgentLoopPath(
            ours_path.manager, args.num_prompts, args.n, via_ray=True
        )
    paths = {"raw AsyncLLM": raw.rate, **{name: p.rate for name, p in agentloop_paths.items()}}
    rates: dict[str, list[float]] = {name: [] for name in paths}
    try:
        # Every engine is alive for the whole run and the passes alternate (raw, agentloop, raw,
        # ...), so
        # slow drift of the machine (other tenants, thermal, page cache) hits both sides alike.  Two
        # full-size warm-up passes each first: CPU kernels compile per batch shape.
        for _ in range(2):
            for fn in paths.values():
                fn()
        for _ in range(args.repeats):
            for name, fn in paths.items():
                # An idle vLLM CPU worker busy-polls (sched_yield) for 1 s after its last step
                # before it
                # blocks; on the shared core that would slow whichever engine runs next.  Let it
                # settle.
                time.sleep(IDLE_SETTLE_S)
                rates[name].append(fn())
    finally:
        for p in agentloop_paths.values():
            if not p.via_ray:  # shares the first path's manager
                p.manager.shutdown()
        raw.close()
        ray.shutdown()

    raw_rates = np.array(rates["raw AsyncLLM"])
    print(
        f"\n{args.num_prompts} prompts ({args.num_prompts // args.n} distinct x "
        f"n={args.n}) x {args.max_tokens} "
        f"tokens, {args.repeats} timed passes each, alternating, device {args.device}, "
        f"{args.num_workers} worker(s)"
    )
    print(f"{'path':<28}{'tok/s (median)':>16}{'ratio (median of pairs)':>26}   passes")
    for name, values in rates.items():
        arr = np.array(values)
        pair = float(np.median(arr / raw_rates))
        print(
            f"{name:<28}{statistics.median(values):>16.0f}{pair:>26.3f}   "
            f"{np.round(arr).astype(int).tolist()}"
        )
    ours = np.array(rates["AgentLoopManager (1 srv)"])
    ratio = statistics.median(ours) / statistics.median(raw_rates)
    serial = np.array(ours_path.serial_ms[-args.repeats:])
    print(
        f"agentloop serial time per batch (wall - slowest sample's engine wait): median "
        f"{np.median(serial):.0f} ms "
        f"(interquartile {np.percentile(serial, 25):.0f}-{np.percentile(serial, 75):.0f} ms)"
    )
    after = np.array(ours_path.after_ms[-args.repeats:])
    print(
        f"agentloop serial time after the last sample (padding, transfer, concat, checks): median "
        f"{np.median(after):.1f} ms (max {after.max():.1f} ms); before the first request and "
        f"per-sample work: median {np.median(serial - after):.1f} ms"
    )
    for name, p in agentloop_paths.items():
        if p is not ours_path:
            print(f"{name.strip()}: after the last sample median "
                  f"{np.median(p.after_ms[-args.repeats:]):.1f} ms")
    pairs = ours / raw_rates
    q25, q50, q75 = np.percentile(pairs, [25, 50, 75])
    print(f"ratio agentloop/raw: {ratio:.3f} (medians); paired passes: median {q50:.3f}, "
          f"interquartile {q25:.3f}-{q75:.3f}, min {pairs.min():.3f}, max {pairs.max():.3f}")


if __name__ == "__main__":
    main()
