"""Weight sync into a live vLLM server: streamed buckets vs the whole-dict temporary-file path, in
one run.

For each model size a random Qwen2-architecture checkpoint is written locally (no hub; the tiny
model's tokenizer), one AgentLoopManager with one vLLM server serves it, and the same fresh state
dict is loaded alternately by

* ``bucketed``: ``manager.update_weights(state_dict, bucket_mb=...)`` (buckets through the object
  store, tensors straight into the engine worker's memory), and
* ``file`` (baseline, the pre-streaming path):
  ``manager._update_weights_whole(state_dict, transport="file")`` (the whole dict as one object, the
  server writes it to a temporary safetensors file the engine reloads),

``--repeats`` times each (bucketed, file, bucketed, file, …).  Reported per path: wall seconds of
the call (median and min–max) and peak extra resident memory while it runs (RSS sampled every 10 ms
minus the RSS just before the call) of the driver, the server actor and the engine processes (its
EngineCore and worker); shared object-store pages count in every process that touches them.  The
file path's page cache is not in any RSS. Before timing, both paths load the same weights once and
must give identical greedy log-probs.

    python scripts/bench_weight_sync.py [--sizes 1m,50m,500m] [--repeats 3] [--bucket-mb 512]
    [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch

# name -> (hidden, layers, heads, kv heads, mlp); vocab 2048 (the tiny tokenizer), untied embeddings
SHAPES = {
    "1m": (128, 2, 4, 2, 512), "50m": (512, 13, 8, 2, 2048), "500m": (1024, 32, 16, 4, 4096),
}
VOCAB = 2048


def build_model(size: str, root: Path, dtype: torch.dtype) -> Path:
    """A random Qwen2 checkpoint of shape ``SHAPES[size]`` with the tiny model's tokenizer
    (cached in ``root``)."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config

    from agentloop.testing.tiny_model import build_tokenizer

    out = root / f"qwen2-{size}-{str(dtype).removeprefix('torch.')}"
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    hidden, layers, heads, kv_heads, mlp = SHAPES[size]
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=mlp, max_position_embeddings=2048,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype=str(dtype).removeprefix("torch."),
    )
    config.save_pretrained(str(out))
    save_file(random_state_dict(config, dtype, seed=0), str(out / "model.safetensors"))
    return out


def random_state_dict(config: Any, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """N(0, 0.02) weights (norms at 1) with the names and shapes of ``Qwen2ForCausalLM(config)``."""
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Qwen2ForCausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    return {
        k: (
            torch.ones(s) if k.endswith("norm.weight") else torch.randn(s, generator=gen) * 0.02
        ).to(dtype)
        for k, s in shapes.items()
    }


class PeakRss:
    """Samples the RSS of some processes every ``interval`` seconds; ``peaks()`` gives the extra
    bytes over the RSS at start, per group of processes (the group's summed RSS)."""

    def __init__(self, groups: dict[str, list[int]], interval: float = 0.01) -> None:
        self.groups = {g: [psutil.Process(p) for p in pids] for g, pids in groups.items()}
        self.interval = interval
        self.base = self._sample()
        self.peak = dict(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> dict[str, int]:
        return {g: sum(p.memory_info().rss for p in procs) for g, procs in self.groups.items()}

    def _run(self) -> None:
        while not self._stop.is_set():
            for g, rss in self._sample().items():
                self.peak[g] = max(self.peak[g], rss)
            time.sleep(self.interval)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        for g, rss in self._sample().items():
            self.peak[g] = max(self.peak[g], rss)

    def peaks(self) -> dict[str, int]:
        return {g: self.peak[g] - self.base[g] for g in self.groups}


def make_manager(model: Path, dtype: torch.dtype) -> Any:
    from omegaconf import OmegaConf

    from agentloop.config import default_config
    from agentloop.rollout.manager import AgentLoopManager

    cfg = default_config()
    for k, v in {
        "actor_rollout_ref.model.path": str(model), "data.max_prompt_length": 64,
        "data.max_response_length": 8,
        "actor_rollout_ref.rollout.dtype": str(dtype).removeprefix("torch."),
        "actor_rollout_ref.rollout.calculate_log_probs": True,
        "actor_rollout_ref.rollout.free_cache_engine": False,
        "actor_rollout_ref.rollout.max_num_seqs": 4,
        "actor_rollout_ref.rollout.agent.num_workers": 1,
        "actor_rollout_ref.rollout.server.num_servers": 1,
        "actor_rollout_ref.rollout.server.device": "cpu",
    }.items():
        OmegaConf.update(cfg, k, v)
    return AgentLoopManager(cfg)


def greedy_logprobs(manager: Any) -> torch.Tensor:
    from agentloop.batch.data import rows_to_batch

    batch = rows_to_batch([{"prompt": [{"role": "user", "content": "Weights, please."}]}])
    batch.meta_info["validate"] = True
    return manager.generate_sequences(batch).batch["rollout_log_probs"]


def process_groups(manager: Any) -> dict[str, list[int]]:
    server_pid = int(manager.servers.info[0]["pid"])
    engine = [c.pid for c in psutil.Process(server_pid).children(recursive=True)]
    return {"driver": [os.getpid()], "server": [server_pid], "engine": engine}


def bench_size(size: str, args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    from transformers import AutoConfig

    dtype = getattr(torch, args.dtype)
    model = build_model(size, root, dtype)
    weights = random_state_dict(AutoConfig.from_pretrained(str(model)), dtype, seed=1)
    n_params = sum(t.numel() for t in weights.values())
    n_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    manager = make_manager(model, dtype)
    paths = {
        "bucketed": lambda: manager.update_weights(weights, bucket_mb=args.bucket_mb),
        "file": lambda: manager._update_weights_whole(weights, transport="file"),
    }
    try:
        paths["file"]()
        reference = greedy_logprobs(manager)
        paths["bucketed"]()
        if not torch.equal(reference, greedy_logprobs(manager)):
            raise SystemExit(f"{size}: the two paths loaded different weights")
        groups = process_groups(manager)
        runs: dict[str, list[tuple[float, dict[str, int]]]] = {name: [] for name in paths}
        for _ in range(args.repeats):
            for name, fn in paths.items():
                time.sleep(args.settle)
                with PeakRss(groups) as rss:
                    t0 = time.perf_counter()
                    fn()
                    seconds = time.perf_counter() - t0
                runs[name].append((seconds, rss.peaks()))
    finally:
        manager.shutdown()
    return [summarise(size, name, n_params, n_bytes, r) for name, r in runs.items()]


def summarise(
    size: str, path: str, n_params: int, n_bytes: int, runs: list[tuple[float, dict[str, int]]]
) -> dict:
    seconds = [s for s, _ in runs]
    peak = {g: max(p[g] for _, p in runs) / 2**20 for g in runs[0][1]}
    return {
        "size": size, "params": n_params, "mb": n_bytes / 2**20, "path": path,
        "median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds),
        "peak_mb": peak,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'model':>6} {'params':>7} {'MiB':>6} {'path':>9} {'seconds (min-max)':>22} "
            f"{'driver':>8} {'server':>8} {'engine':>8} {'time vs file':>13} {'mem vs file':>12}")
    print(head)
    print("-" * len(head))
    base = {r["size"]: r for r in rows if r["path"] == "file"}
    for r in rows:
        b = base[r["size"]]
        mem, bmem = sum(r["peak_mb"].values()), sum(b["peak_mb"].values())
        spread = f"{r['median_s']:.3f} ({r['min_s']:.3f}-{r['max_s']:.3f})"
        print(
            f"{r['size']:>6} {r['params'] / 1e6:>6.1f}M {r['mb']:>6.0f} {r['path']:>9} "
            f"{spread:>22} "
            f"{r['peak_mb']['driver']:>8.0f} {r['peak_mb']['server']:>8.0f} "
            f"{r['peak_mb']['engine']:>8.0f} "
            f"{r['median_s'] / b['median_s']:>12.2f}x "
            f"{mem / bmem if bmem > 0 else float('nan'):>11.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1m,50m", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=512)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--settle", type=float, default=1.0, help="seconds of idle before each timed call"
    )
    parser.add_argument(
        "--cache-dir", default=os.path.expanduser("~/.cache/agentloop/bench-weight-sync")
    )
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # never joins others
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR")
    rows: list[dict[str, Any]] = []
    try:
        for size in args.sizes.split(","):
            rows += bench_size(size.strip(), args, Path(args.cache_dir))
            print(f"[{size}] done", flush=True)
    finally:
        ray.shutdown()
    print(
        f"\nweight sync, {args.dtype}, bucket {args.bucket_mb:g} MiB, 1 vLLM CPU server, "
        f"{args.repeats} runs per "
        "path (alternating); peak extra RSS in MiB\n"
    )
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
