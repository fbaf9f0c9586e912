"""Per-turn latency through the OpenAI gateway vs a direct router call, on the same vLLM CPU engine.

``--sessions`` concurrent conversations of ``--turns`` turns each (a user question, ``--max-tokens``
sampled tokens with EOS ignored, then a follow-up user turn) run twice in one process on one engine:

* direct: the client renders the whole conversation with the chat template and calls
  ``AsyncLLMServerManager.generate`` with the ids (what an agent loop does per turn, minus its
  incremental encoding);
* gateway: the same conversation as OpenAI chat requests over HTTP on loopback (``httpx``), through
  the session store (only the new suffix is encoded).

Prints p50 / p99 per-turn latency of both, their ratio, and the tokens the gateway encoded per turn
against the full prompt length per turn.

    python scripts/bench_gateway.py [--sessions 16] [--turns 4] [--max-tokens 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from typing import Any

from omegaconf import OmegaConf


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def conversation_step(messages: list[dict[str, Any]], reply: str, turn: int) -> list[dict[str, Any]]:
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": f"And then? ({turn})"}]


async def direct_session(router: Any, tokenizer: Any, first: str, args: argparse.Namespace,
                         lat: list[float]) -> None:
    messages = [{"role": "user", "content": first}]
    params = {"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": True}
    sticky = uuid.uuid4().hex
    for turn in range(args.turns):
        t0 = time.perf_counter()
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        out = await router.generate(uuid.uuid4().hex, prompt_ids=ids, sampling_params=params, sticky_key=sticky)
        reply = tokenizer.decode(out.token_ids, skip_special_tokens=True).strip()
        lat.append(time.perf_counter() - t0)
        messages = conversation_step(messages, reply, turn)


async def gateway_session(client: Any, handle: Any, first: str, args: argparse.Namespace,
                          lat: list[float]) -> None:
    messages = [{"role": "user", "content": first}]
    headers = {"Authorization": f"Bearer {handle.api_key}"}
    for turn in range(args.turns):
        t0 = time.perf_counter()
        r = await client.post(f"{handle.base_url}/chat/completions", headers=headers,
                              json={"model": "m", "messages": messages, "temperature": 0,
                                    "max_tokens": args.max_tokens})
        r.raise_for_status()
        reply = r.json()["choices"][0]["message"]["content"]
        lat.append(time.perf_counter() - t0)
        messages = conversation_step(messages, reply, turn)


async def main_async(args: argparse.Namespace) -> None:
    import httpx
    from transformers import AutoTokenizer

    from agentloop.gateway.actor import GatewayActor
    from agentloop.routing import AsyncLLMServerManager
    from agentloop.servers.vllm import VLLMServer
    from agentloop.testing.tiny_model import ensure_tiny_model

    model_path = str(ensure_tiny_model())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rollout = OmegaConf.create({
        "prompt_length": 768, "response_length": 256, "dtype": "float32", "max_model_len": None,
        "max_num_seqs": 64, "max_num_batched_tokens": 8192, "enable_prefix_caching": True, "enforce_eager": False,
        "seed": 0, "disable_log_stats": True, "tensor_model_parallel_size": 1, "gpu_memory_utilization": 0.5,
        "free_cache_engine": False, "enable_chunked_prefill": True, "engine_kwargs": {"vllm": {}},
        "calculate_log_probs": True, "multi_turn": {"format": "hermes"}, "server": {"max_cache_size": 10000},
        "gateway": {"host": "127.0.0.1"},
    })
    model = OmegaConf.create({"path": model_path})
    server = VLLMServer(rollout, model)
    await server.start()
    router = AsyncLLMServerManager([server])
    gateway = GatewayActor(rollout, model, [server], tokenizer=tokenizer)
    await gateway.start()
    firsts = [f"Tell me a story about topic number {i}." for i in range(args.sessions)]
    results: dict[str, list[float]] = {"direct": [], "gateway": []}
    encoded, prompt_lens = 0, 0
    try:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=256)) as client:
            for rep in range(args.repeats + 1):  # the first round warms both paths up
                for side in ("direct", "gateway") if rep % 2 == 0 else ("gateway", "direct"):
                    lat: list[float] = []
                    if side == "direct":
                        await asyncio.gather(*(direct_session(router, tokenizer, f, args, lat) for f in firsts))
                    else:
                        handles = [await gateway.create_session(sampling_params={"ignore_eos": True}) for _ in firsts]
                        await asyncio.gather(*(gateway_session(client, h, f, args, lat)
                                               for h, f in zip(handles, firsts, strict=True)))
                        for h in handles:
                            done = await gateway.finalize(h.session_id)
                            if rep > 0:
                                encoded += done["stats"]["num_encoded_tokens"]
                                [traj] = done["trajectories"]
                                prompt_lens += _prompt_tokens_per_turn(traj)
                    if rep > 0:
                        results[side] += lat
    finally:
        await gateway.shutdown()
        await server.shutdown()
    report(results, encoded, prompt_lens, args)


def _prompt_tokens_per_turn(traj: Any) -> int:
    """Sum over turns of each turn's prompt length (what re-encoding the whole conversation tokenizes)."""
    mask = traj.response_mask
    starts = [i for i, m in enumerate(mask) if m == 1 and (i == 0 or mask[i - 1] == 0)]
    return sum(len(traj.prompt_ids) + i for i in starts)


def report(results: dict[str, list[float]], encoded: int, prompt_lens: int, args: argparse.Namespace) -> None:
    n_turns = len(results["gateway"])
    print(f"{args.sessions} sessions x {args.turns} turns x {args.max_tokens} tokens, {args.repeats} repeats")
    print(f"{'path':<10}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}")
    for side in ("direct", "gateway"):
        vals = results[side]
        print(f"{side:<10}{percentile(vals, 50) * 1e3:>10.1f}{percentile(vals, 99) * 1e3:>10.1f}"
              f"{statistics.mean(vals) * 1e3:>10.1f}")
    print(f"tokens encoded per turn: gateway {encoded / n_turns:.1f} vs full prompt {prompt_lens / n_turns:.1f}")
    p50 = percentile(results["gateway"], 50) / percentile(results["direct"], 50)
    p99 = percentile(results["gateway"], 99) / percentile(results["direct"], 99)
    print(f"ratio gateway/direct: p50 {p50:.2f}  p99 {p99:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
