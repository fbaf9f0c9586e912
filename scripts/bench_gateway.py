"""Sessions/s and per-turn latency through 1, 2, 4 … gateway actors vs direct router calls, same
engine.

``--sessions`` concurrent conversations of ``--turns`` turns each (a user question, ``--max-tokens``
sampled tokens with EOS ignored, then a follow-up user turn) run on local Ray, as a rollout runs
them: the engine is a Ray actor and each path is measured in one run, passes alternating:

* direct (the baseline): the driver renders the whole conversation with the chat template and calls
  ``AsyncLLMServerManager.generate`` on the engine actor (what an agent loop does per turn, minus
  its incremental encoding);
* ``gateways=N``: the same conversation as OpenAI chat requests over HTTP on loopback (``aiohttp``
  in the driver) to N :class:`~agentloop.gateway.actor.GatewayActor` actors (sessions spread by
  :class:`~agentloop.gateway.actor.GatewayManager`, opened and finalized as the ``openai_agent``
  loop does), each routing to the same engine actor.

``--engine fake`` (default) is :class:`agentloop.testing.ScriptedServer` replying after ``--delay``
seconds, so the numbers are the gateway's own overhead at N concurrent sessions (try ``--sessions
1000``); ``--engine vllm`` is the tiny model on vLLM CPU.  Prints, per path, the median over
repeats of sessions/s, p50 / p99 per-turn latency, the ratio to direct and the CPU milliseconds per
turn of the driver (client side), the gateway actor processes and the engine actor; every trajectory
is checked to be its own conversation.

    python scripts/bench_gateway.py [--engine fake|vllm] [--sessions 16] [--turns 4] [--max-tokens
    16]
                                    [--repeats 3] [--delay 0.01] [--gateways 1,2,4]
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


def conversation_step(
    messages: list[dict[str, Any]], reply: str, turn: int
) -> list[dict[str, Any]]:
    return [
        *messages, {"role": "assistant", "content": reply},
        {"role": "user", "content": f"And then? ({turn})"},
    ]


async def direct_session(router: Any, tokenizer: Any, first: str, args: argparse.Namespace,
                         lat: list[float]) -> None:
    messages = [{"role": "user", "content": first}]
    params = {"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": True}
    sticky = uuid.uuid4().hex
    for turn in range(args.turns):
        t0 = time.perf_counter()
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        out = await router.generate(
            uuid.uuid4().hex, prompt_ids=ids, sampling_params=params, sticky_key=sticky
        )
        reply = tokenizer.decode(out.token_ids, skip_special_tokens=True).strip()
        lat.append(time.perf_counter() - t0)
        messages = conversation_step(messages, reply, turn)


async def gateway_session(
    client: Any, gateways: Any, tokenizer: Any, first: str, args: argparse.Namespace,
    lat: list[float], stats: dict[str, int],
) -> None:
    handle = await gateways.create_session(sampling_params={"ignore_eos": True})
    messages = [{"role": "user", "content": first}]
    headers = {"Authorization": f"Bearer {handle.api_key}"}
    for turn in range(args.turns):
        t0 = time.perf_counter()
        body = {"model": "m", "messages": messages, "temperature": 0, "max_tokens": args.max_tokens}
        async with client.post(
            f"{handle.base_url}/chat/completions", headers=headers, json=body
        ) as r:
            r.raise_for_status()
            reply = (await r.json())["choices"][0]["message"]["content"]
        lat.append(time.perf_counter() - t0)
        messages = conversation_step(messages, reply, turn)
    done = await gateways.finalize(handle.session_id)
    stats["encoded"] += done["stats"]["num_encoded_tokens"]
    [traj] = done["trajectories"]  # one session, one branch: exactly one trajectory
    text = tokenizer.decode(list(traj.prompt_ids) + list(traj.response_ids))
    if text.count("topic number") != 1 or first not in text:  # a lost or merged trajectory
        raise AssertionError(f"session {first!r} got a trajectory not its own: {text[:200]!r}")
    stats["sessions_checked"] += 1
    stats["prompt_lens"] += _prompt_tokens_per_turn(traj)


def rollout_config(args: argparse.Namespace) -> Any:
    return OmegaConf.create(
        {
            "prompt_length": 768, "response_length": 256, "dtype": "float32", "max_model_len": None,
            "max_num_seqs": 64, "max_num_batched_tokens": 8192, "enable_prefix_caching": True,
            "enforce_eager": False, "seed": 0, "disable_log_stats": True,
            "tensor_model_parallel_size": 1, "gpu_memory_utilization": 0.5,
            "free_cache_engine": False, "enable_chunked_prefill": True,
            "engine_kwargs": {"vllm": {}}, "calculate_log_probs": True,
            "multi_turn": {"format": "hermes"}, "server": {"max_cache_size": 10000},
            "gateway": {"host": "127.0.0.1"},
        }
    )


def start_engine(args: argparse.Namespace, rollout: Any, model: Any, tokenizer: Any) -> Any:
    """The engine actor both paths share: the fake one (fixed replies after ``--delay``) or vLLM
    CPU."""
    import ray

    if args.engine == "fake":
        from agentloop.testing import ScriptedServer

        word = tokenizer.encode(" story", add_special_tokens=False)[0]
        n = args.max_tokens

        def reply(prompt_ids: list[int], params: dict[str, Any], request_id: str) -> list[int]:
            return [word] * int(params.get("max_tokens") or n)

        cls = ray.remote(num_cpus=0)(ScriptedServer).options(max_concurrency=100000)
        return cls.remote(reply, eos_token_id=tokenizer.eos_token_id, delay=args.delay)
    from agentloop.config import ServerSections
    from agentloop.servers.vllm import VLLMServer

    sections = ServerSections.from_slices(rollout, model)
    server = ray.remote(num_cpus=0)(VLLMServer).options(max_concurrency=100000).remote(sections)
    ray.get(server.start.remote())
    return server


async def run_pass(side: str, args: argparse.Namespace, env: dict[str, Any], firsts: list[str],
                   lat: list[float], stats: dict[str, int]) -> None:
    """One pass: every session once, all concurrent."""
    if side == "direct":
        await asyncio.gather(*(direct_session(env["router"], env["tokenizer"], f, args, lat)
                               for f in firsts))
        return
    gateways = env["gateways"][side]
    await asyncio.gather(*(gateway_session(env["client"], gateways, env["tokenizer"], f, args, lat,
                                           stats) for f in firsts))


async def main_async(args: argparse.Namespace) -> None:
    import aiohttp
    import ray
    from transformers import AutoTokenizer

    from agentloop.config import GatewaySections
    from agentloop.gateway.actor import GatewayManager, start_gateways
    from agentloop.routing import AsyncLLMServerManager
    from agentloop.testing.tiny_model import ensure_tiny_model

    model_path = str(ensure_tiny_model())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rollout = rollout_config(args)
    model = OmegaConf.create({"path": model_path})
    ray.init(include_dashboard=False, logging_level="ERROR")
    server = start_engine(args, rollout, model, tokenizer)
    env: dict[str, Any] = {"router": AsyncLLMServerManager([server]), "tokenizer": tokenizer,
                           "gateways": {}}
    counts = [int(n) for n in args.gateways.split(",")]
    for n in counts:
        sections = GatewaySections.from_slices(rollout, model)
        env["gateways"][f"gateways={n}"] = GatewayManager(start_gateways(sections, [server], n=n))
    sides = ["direct", *env["gateways"]]
    firsts = [f"Tell me a story about topic number {i}." for i in range(args.sessions)]
    results: dict[str, list[float]] = {side: [] for side in sides}
    walls: dict[str, list[float]] = {side: [] for side in sides}
    cpu: dict[str, list[tuple[float, ...]]] = {side: [] for side in sides}
    stats = {"encoded": 0, "prompt_lens": 0, "sessions_checked": 0}
    try:
        # idle connections are dropped before uvicorn's 5 s keep-alive ends: never reused while
        # the server closes them (a ServerDisconnectedError when a pass starts ~5 s after the last)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0)
        async with aiohttp.ClientSession(connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=600)) as client:
            env["client"] = client
            for rep in range(args.repeats + 1):  # the first round warms every path up
                # rotate: A B C, B C A...
                order = sides[rep % len(sides):] + sides[:rep % len(sides)]
                for side in order:
                    lat: list[float] = []
                    round_stats = {"encoded": 0, "prompt_lens": 0, "sessions_checked": 0}
                    actors = [] if side == "direct" else env["gateways"][side].gateways
                    gw0, cpu0 = await actors_cpu(actors), time.process_time()
                    engine0 = await actors_cpu([server])
                    t0 = time.perf_counter()
                    await run_pass(side, args, env, firsts, lat, round_stats)
                    wall = time.perf_counter() - t0
                    used = (time.process_time() - cpu0, await actors_cpu(actors) - gw0,
                            await actors_cpu([server]) - engine0)
                    await asyncio.sleep(0.5)  # let the actors settle between passes
                    if rep > 0:
                        walls[side].append(wall)
                        cpu[side].append(used)
                        results[side] += lat
                        for k, v in round_stats.items():
                            stats[k] += v
    finally:
        for manager in env["gateways"].values():
            for actor in manager.gateways:
                ray.get(actor.shutdown.remote())
        if args.engine == "vllm":
            ray.get(server.shutdown.remote())
        ray.shutdown()
    report(results, walls, cpu, stats, args)


def _process_time(actor: Any) -> float:
    return time.process_time()


async def actors_cpu(actors: list[Any]) -> float:
    """CPU seconds the processes of ``actors`` have used so far (all threads)."""
    return sum(await asyncio.gather(*(a.__ray_call__.remote(_process_time) for a in actors)))


def _prompt_tokens_per_turn(traj: Any) -> int:
    """Sum over turns of each turn's prompt length (what re-encoding the whole conversation
    tokenizes)."""
    mask = traj.response_mask
    starts = [i for i, m in enumerate(mask) if m == 1 and (i == 0 or mask[i - 1] == 0)]
    return sum(len(traj.prompt_ids) + i for i in starts)


def report(results: dict[str, list[float]], walls: dict[str, list[float]],
           cpu: dict[str, list[tuple[float, ...]]], stats: dict[str, int],
           args: argparse.Namespace) -> None:
    """Per path: the median over repeats of sessions/s, per-turn latency percentiles over all
    repeats, the ratio of medians to direct, and the median CPU ms per turn of the driver (client
    side), of the gateway actors' processes and of the engine actor."""
    turns = args.sessions * args.turns
    print(f"engine {args.engine}: {args.sessions} concurrent sessions x {args.turns} turns x "
          f"{args.max_tokens} tokens, {args.repeats} repeats (passes rotating; medians)")
    print(f"{'path':<14}{'sessions/s':>12}{'p50 ms':>10}{'p99 ms':>10}{'ratio':>8}"
          f"{'cpu ms/turn: driver':>21}{'gateways':>10}{'engine':>8}")
    direct_rate = statistics.median(args.sessions / w for w in walls["direct"])
    for side, vals in results.items():
        rate = statistics.median(args.sessions / w for w in walls[side])
        driver = statistics.median(c[0] for c in cpu[side]) / turns * 1e3
        gateway = statistics.median(c[1] for c in cpu[side]) / turns * 1e3
        engine = statistics.median(c[2] for c in cpu[side]) / turns * 1e3
        print(f"{side:<14}{rate:>12.1f}{percentile(vals, 50) * 1e3:>10.1f}"
              f"{percentile(vals, 99) * 1e3:>10.1f}{rate / direct_rate:>8.2f}"
              f"{driver:>21.2f}{gateway:>10.2f}{engine:>8.2f}")
    n_turns = max(1, stats["sessions_checked"] * args.turns)
    print(f"tokens encoded per turn: gateway {stats['encoded'] / n_turns:.1f} vs full prompt "
          f"{stats['prompt_lens'] / n_turns:.1f}")
    print(
        f"trajectories checked: {stats['sessions_checked']} sessions, each exactly one "
        f"trajectory "
        "holding only its own conversation"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("fake", "vllm"), default="fake")
    parser.add_argument(
        "--delay", type=float, default=0.01, help="fake engine: seconds per generation"
    )
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--gateways", default="1,2,4", help="gateway actor counts to compare, e.g. 1,2,4"
    )
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
