"""Overhead of the agentloop stack over the raw engine, measured in one run.

The same requests (``--num-prompts`` chat prompts, exactly ``--max-tokens`` new tokens each, EOS
ignored) go (a) straight into a vLLM ``AsyncLLM`` in this process and (b) through
``AgentLoopManager.generate_sequences`` with one server actor built from the same engine settings.
Each side gets two full-size warm-up passes, then ``--repeats`` timed passes, alternating.  Prints both
throughputs and the ratio agentloop / raw (goal: >= 0.97).

    python scripts/bench_overhead.py [--num-prompts 256] [--max-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid

import numpy as np
from omegaconf import OmegaConf


def make_config(model_path: str, args: argparse.Namespace):
    from agentloop.config import default_config

    cfg = default_config()
    overrides = {
        "actor_rollout_ref.model.path": model_path,
        "data.max_prompt_length": 256,
        "data.max_response_length": args.max_tokens,
        "actor_rollout_ref.rollout.dtype": "float32",
        "actor_rollout_ref.rollout.ignore_eos": True,
        "actor_rollout_ref.rollout.free_cache_engine": False,
        "actor_rollout_ref.rollout.max_num_seqs": args.num_prompts,
        "actor_rollout_ref.rollout.agent.num_workers": args.num_workers,
        "actor_rollout_ref.rollout.server.num_servers": 1,
        "actor_rollout_ref.rollout.server.device": "cpu",
        "actor_rollout_ref.rollout.server.num_cpus_per_server": 1,
    }
    for k, v in overrides.items():
        OmegaConf.update(cfg, k, v)
    OmegaConf.resolve(cfg)
    return cfg


def make_batch(n: int):
    from agentloop.data import rows_to_batch

    topics = ["the sea", "a cat", "numbers", "rain", "the moon", "bread", "a map", "music"]
    rows = [{"prompt": [{"role": "user", "content": f"Tell me about {topics[i % 8]} (#{i})."}]} for i in range(n)]
    return rows_to_batch(rows)


async def raw_pass(engine, prompts: list[list[int]], params) -> tuple[float, int]:
    from vllm.inputs import TokensPrompt

    async def one(ids: list[int]) -> int:
        final = None
        async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), params, uuid.uuid4().hex):
            final = out
        return len(final.outputs[0].token_ids)

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - t0, sum(counts)


def run_raw(cfg, prompts: list[list[int]], repeats: int) -> list[float]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from agentloop.servers.placement import _cpu_bind_env
    from agentloop.servers.vllm import _engine_args

    os.environ.update(_cpu_bind_env(0, 1))
    r = cfg.actor_rollout_ref.rollout
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(  # the raw engine used at its best: no detokenizing, final output only
        max_tokens=int(r.response_length), temperature=1.0, ignore_eos=True, detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )

    async def main() -> list[float]:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**_engine_args(r, cfg.actor_rollout_ref.model, True)))
        try:
            for _ in range(2):  # warm-up at full batch size (CPU kernels compile per batch shape)
                await raw_pass(engine, prompts, params)
            rates = []
            for _ in range(repeats):
                wall, tokens = await raw_pass(engine, prompts, params)
                rates.append(tokens / wall)
            return rates
        finally:
            engine.shutdown()

    return asyncio.run(main())


def run_agentloop(cfg, batch, repeats: int) -> list[float]:
    from agentloop.manager import AgentLoopManager

    manager = AgentLoopManager(cfg)
    try:
        for _ in range(2):  # warm-up at full batch size, as for the raw engine
            manager.generate_sequences(batch)
        rates = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = manager.generate_sequences(batch)
            wall = time.perf_counter() - t0
            rates.append(float(out.batch["response_mask"].sum()) / wall)
        return rates
    finally:
        manager.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument("--compare-unbatched", action="store_true",
                        help="also run with rollout.server.batch_calls=false (one Ray call per request)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from agentloop.loops.prompt import apply_chat_template
    from agentloop.testing.tiny_model import ensure_tiny_model
    from agentloop.worker import load_tokenizer

    cfg = make_config(str(ensure_tiny_model()), args)
    batch = make_batch(args.num_prompts)
    tok = load_tokenizer(cfg.actor_rollout_ref.model)
    messages = batch.non_tensor_batch["raw_prompt"]
    prompts = [apply_chat_template(tok, list(m), add_generation_prompt=True) for m in messages]

    raw = run_raw(cfg, prompts, args.repeats)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    ours = run_agentloop(cfg, batch, args.repeats)
    unbatched = None
    if args.compare_unbatched:
        OmegaConf.update(cfg, "actor_rollout_ref.rollout.server.batch_calls", False)
        unbatched = run_agentloop(cfg, batch, args.repeats)
    ray.shutdown()

    raw_m, ours_m = statistics.median(raw), statistics.median(ours)
    print(f"\n{args.num_prompts} prompts x {args.max_tokens} tokens, {args.repeats} timed passes each (median)")
    print(f"{'path':<28}{'tok/s (median)':>16}{'passes':>40}")
    print(f"{'raw AsyncLLM':<28}{raw_m:>16.0f}{str(np.round(raw).astype(int).tolist()):>40}")
    print(f"{'AgentLoopManager (1 srv)':<28}{ours_m:>16.0f}{str(np.round(ours).astype(int).tolist()):>40}")
    if unbatched is not None:
        un_m = statistics.median(unbatched)
        print(f"{'  … batch_calls=false':<28}{un_m:>16.0f}{str(np.round(unbatched).astype(int).tolist()):>40}")
        print(f"ratio unbatched/raw: {un_m / raw_m:.3f}")
    print(f"ratio agentloop/raw: {ours_m / raw_m:.3f}")


if __name__ == "__main__":
    main()
