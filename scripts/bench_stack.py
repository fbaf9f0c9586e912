"""The stack's own CPU time per sample, with and without the render cache (or the GC freeze), in one
run.

One ``AgentLoopWorker`` in this process runs ``single_turn_agent`` batches against a zero-latency
:class:`~agentloop.testing.ScriptedServer` (64-token replies with log-probs) with the tiny model's
real tokenizer, so everything timed is agentloop's Python: rendering, routing, loop bookkeeping,
reward and padding into a ``DataProto``.  This is the serial cost that weighs on short GPU batches
(docs/benchmarks.md, "On a GPU").  Each pass gets prompts it has not seen (a trainer's next step),
each repeated ``--n`` times in a row as GRPO's ``rollout.n`` repeats them; passes alternate between
the render cache on (shipped) and off (``RENDER_CACHE_SIZE = 0``: the previous design).
``--agent tool_agent``: each row makes one calculator call (the real tool) and then answers, so a
tool turn's encoding is measured too.

The process's garbage collector is set as a worker actor sets its own (``rollout.gc_freeze``: the
start-up heap frozen; ``rollout.gc_threshold``: the young generation's threshold;
:func:`agentloop.utils.gcheap.tune_collector`), so the figures are the worker's as it runs in its
actor.  ``--compare gc``: those settings (shipped) vs CPython's defaults, the render cache on.

    python scripts/bench_stack.py [--num-prompts 256] [--n 1 8] [--repeats 15] [--agent tool_agent]
    [--compare gc]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

TOOLS_YAML = Path(__file__).resolve().parent.parent / "examples" / "calculator_agent" / "tools.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=256, help="rows per batch")
    parser.add_argument(
        "--n", type=int, nargs="+", default=[1, 8], help="rows per distinct prompt (rollout.n)"
    )
    parser.add_argument(
        "--repeats", type=int, default=15, help="timed passes per setting (after 3 warm-ups)"
    )
    parser.add_argument(
        "--compare",
        choices=["cache", "gc"],
        default="cache",
        help="cache: render cache on vs off; gc: the collector as worker actors set it "
        "(rollout.gc_freeze, rollout.gc_threshold) vs CPython's defaults, cache on",
    )
    parser.add_argument(
        "--agent",
        choices=["single_turn_agent", "tool_agent"],
        default="single_turn_agent",
        help="tool_agent: every row makes one calculator call (a real "
        "CalculatorTool), then answers",
    )
    args = parser.parse_args()

    from omegaconf import OmegaConf

    from agentloop.batch.data import rows_to_batch
    from agentloop.config import default_config
    from agentloop.loops import prompt
    from agentloop.rollout.worker import AgentLoopWorker
    from agentloop.testing import ScriptedServer
    from agentloop.testing.tiny_model import ensure_tiny_model
    from agentloop.tokenization.loader import load_tokenizer
    from agentloop.utils.gcheap import tune_collector

    cfg = default_config()
    OmegaConf.update(cfg, "actor_rollout_ref.model.path", str(ensure_tiny_model()))
    cfg.data.max_prompt_length, cfg.data.max_response_length = 128, 64
    OmegaConf.update(cfg, "actor_rollout_ref.rollout.calculate_log_probs", True)
    if args.agent == "tool_agent":
        cfg.data.max_prompt_length, cfg.data.max_response_length = 512, 256
        for key, value in {
            "multi_turn.enable": True, "multi_turn.format": "hermes",
            "multi_turn.max_assistant_turns": 3, "agent.default_agent_loop": "tool_agent",
            "multi_turn.tool_config_path": str(TOOLS_YAML),
        }.items():
            OmegaConf.update(cfg, f"actor_rollout_ref.rollout.{key}", value)
    OmegaConf.resolve(cfg)
    tok = load_tokenizer(cfg.actor_rollout_ref.model)
    eos = tok.eos_token_id
    call = tok.encode(
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>',
        add_special_tokens=False,
    ) + [eos]
    answer = tok.encode("The answer is 5.", add_special_tokens=False) + [eos]
    called: set[str] = set()

    def reply(ids: list[int], params: dict, request_id: str) -> list[int]:
        if args.agent == "single_turn_agent":
            return [5] * 63 + [eos]
        if request_id in called:  # a tool_agent row keeps its request id across turns
            return answer
        called.add(request_id)
        return call

    server = ScriptedServer(reply, eos_token_id=eos)
    engine_s = [0.0]  # the scripted engine's own time: not agentloop's, but inside each pass
    scripted_generate = server.generate

    async def timed_generate(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await scripted_generate(*a, **kw)
        finally:
            engine_s[0] += time.perf_counter() - t0

    server.generate = timed_generate  # type: ignore[method-assign]
    worker = AgentLoopWorker.from_slices(
        cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model, [server], tokenizer=tok
    )
    steps = itertools.count()

    def batch(group: int):
        step = next(steps)
        rows = [
            {
                "prompt": [
                    {"role": "system", "content": "You are a helpful assistant."},
                    {
                        "role": "user",
                        "content": f"Step {step}: what is {i // group} "
                        f"plus {i // group + 7}? "
                        "Think step by step.",
                    },
                ]
            }
            for i in range(args.num_prompts)
        ]
        return rows_to_batch(rows)

    def one_pass(group: int, setting: Any) -> float:
        if args.compare == "cache":
            prompt.RENDER_CACHE_SIZE = setting
        elif setting:
            gc.freeze()  # O(1): the tracked objects move to the permanent generation
            gc.set_threshold(actor_threshold, *cpython_threshold[1:])
        else:
            gc.unfreeze()
            gc.set_threshold(*cpython_threshold)
        # the fake records every call: a growing heap would slow later passes' GC
        server.calls.clear()
        called.clear()
        data = batch(group)
        engine_s[0] = 0.0
        t0 = time.perf_counter()
        asyncio.run(worker.generate_sequences(data))
        engine_us[setting_name(setting)].append(engine_s[0] / args.num_prompts * 1e6)
        return (time.perf_counter() - t0) / args.num_prompts * 1e6

    # what is measured is what it claims to be
    first = asyncio.run(worker.generate_sequences(batch(1)))
    turns = 4 if args.agent == "tool_agent" else 2  # prompt, call, tool result, answer
    if set(first.non_tensor_batch["status"]) != {"stop"} or set(
        first.non_tensor_batch["__num_turns__"]
    ) != {turns}:
        raise SystemExit(
            f"unexpected rollouts: status "
            f"{set(first.non_tensor_batch['status'])}, turns "
            f"{set(first.non_tensor_batch['__num_turns__'])} (expected stop, {turns})"
        )
    cpython_threshold = gc.get_threshold()
    tune_collector(cfg.actor_rollout_ref.rollout)  # the worker as its actor runs it
    actor_threshold = gc.get_threshold()[0]
    if args.compare == "cache":
        settings: dict[str, Any] = {
            "cache on (shipped)": prompt.RENDER_CACHE_SIZE,
            "cache off (previous)": 0,
        }
    else:
        settings = {"actor's collector": True, "CPython's (previous)": False}
    shipped, previous = settings
    engine_us: dict[str, list[float]] = {name: [] for name in settings}

    def setting_name(value: Any) -> str:
        return next(name for name, v in settings.items() if v == value)
    print(
        f"{args.num_prompts} rows per batch, {args.agent}, zero-latency server, µs of "
        f"agentloop per row "
        f"(median, interquartile, slowest), {args.repeats} alternating passes each"
    )
    for group in args.n:
        for _ in range(3):
            for value in settings.values():
                one_pass(group, value)
        times: dict[str, list[float]] = {name: [] for name in settings}
        for _ in range(args.repeats):
            for name, value in settings.items():
                times[name].append(one_pass(group, value))
        for name, values in times.items():
            q25, q75 = np.percentile(values, [25, 75])
            print(
                f"  n={group:<3} {name:<22} {statistics.median(values):7.0f} µs/row  "
                f"({q25:.0f}-{q75:.0f}, "
                f"slowest {max(values):.0f})"
            )
        print(
            f"  n={group:<3} of which the scripted engine's own time (not agentloop's): "
            f"{statistics.median(engine_us[shipped][-args.repeats:]):.0f} µs/row (shipped), "
            f"{statistics.median(engine_us[previous][-args.repeats:]):.0f} (previous)"
        )
        pairs = np.array(times[previous]) / np.array(times[shipped])
        print(
            f"  n={group:<3} speed-up previous/shipped, paired passes: median "
            f"{np.median(pairs):.2f} "
            f"(interquartile {np.percentile(pairs, 25):.2f}-{np.percentile(pairs, 75):.2f})"
        )
    if args.compare == "cache":
        prompt.RENDER_CACHE_SIZE = settings[shipped]
    gc.unfreeze()
    gc.set_threshold(*cpython_threshold)


if __name__ == "__main__":
    main()
