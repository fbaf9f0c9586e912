"""``agentloop rollout``: roll out a dataset with AgentLoopManager and write the results.

    agentloop rollout [--config FILE.yaml ...] key=value ...

The config is ``agentloop/configs/rollout.yaml`` merged with each ``--config`` in order, then the
Hydra-style overrides.  Writes ``rollout.dataproto``, ``trajectories.jsonl`` and ``summary.json`` to
``output_dir`` (and removes a ``report.html`` / ``report/`` an earlier run left there).  Exit codes
(:mod:`agentloop.cli.failures`): 0 done, 1 an unexpected exception, 2 bad input (one line), 3 too
many failed rows.  Spec: README.md "The rollout job", docs/config.md#exit-codes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from agentloop.batch.data import load_dataset
from agentloop.cli.failures import EXIT_BAD_INPUT, failure_verdict
from agentloop.cli.report import add_report_parser, run_report
from agentloop.cli.summary import (
    format_table,
    pick_rows,
    render_trajectory,
    rewards_by,
    row_scores,
    summary_rows,
    use_colour,
)
from agentloop.cli.verify import add_verify_parser, run_verify
from agentloop.compat.port import add_port_parser, run_port
from agentloop.config import default_config, resolve_config
from agentloop.envs.resolve import batch_rows, check_env_samples
from agentloop.envs.textarena import check_selfplay_samples
from agentloop.errors import AgentLoopError, ConfigError

# called through the module: tests replace load_tokenizer
from agentloop.tokenization import loader as tokenizer_loader

if TYPE_CHECKING:  # torch / Ray are imported only once the input checks passed
    from agentloop.batch.protocol import DataProto


def build_config(config_file: str | list[str] | None, overrides: list[str]) -> DictConfig:
    """Defaults ← each ``config_file`` in order ← ``key=value`` overrides (OmegaConf dotlist syntax,
    ``+`` prefix allowed).  Several files layer: e.g. a task config, then
    ``agentloop/configs/cpu_train.yaml``.
    """
    cfg: Any = default_config()
    files = [config_file] if isinstance(config_file, str) else list(config_file or [])
    for name in files:
        path = Path(name).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"--config {name!r} does not exist: pass the path of a YAML config file"
            )
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.load(path))
        except Exception as e:  # noqa: BLE001 - yaml and OmegaConf raise many types
            raise ConfigError(
                f"--config {name!r} is not a valid YAML config ({_first_line(e)})"
            ) from e
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(
            f"overrides must look like key=value (e.g. "
            f"actor_rollout_ref.rollout.temperature=0.7), "
            f"got {bad}"
        )
    for override in overrides:
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([override.lstrip("+")]))
        except Exception as e:  # noqa: BLE001 - OmegaConf's grammar and merge errors
            raise ConfigError(
                f"cannot apply the override {override!r} ({_first_line(e)}); "
                f"write it as "
                "dotted.key=value, quoting values with special characters"
            ) from e
    return cfg  # type: ignore[return-value]


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _decode(tokenizer: Any, ids: np.ndarray, mask: np.ndarray) -> str:
    return tokenizer.decode(ids[mask.astype(bool)].tolist(), skip_special_tokens=False)


def write_trajectories(output: DataProto, tokenizer: Any, path: Path) -> None:
    """One JSON line per row: decoded text, lengths, turns, status, error, reward (its ``rm_scores``
    summed; null without a reward)."""
    b = _tensors(output)
    p_len = b["prompts"].shape[1]
    attn = b["attention_mask"].numpy()
    nt = output.non_tensor_batch
    scores = row_scores(output)
    with path.open("w") as f:
        for i in range(len(output)):
            p_mask, r_mask = attn[i, :p_len], attn[i, p_len:]
            row = {
                "index": _jsonable(nt["index"][i]) if "index" in nt else i,
                "uid": _jsonable(nt["uid"][i]) if "uid" in nt else None,
                "agent_name": _jsonable(nt["agent_name"][i]) if "agent_name" in nt else None,
                "prompt": _decode(tokenizer, b["prompts"][i].numpy(), p_mask),
                "response": _decode(tokenizer, b["responses"][i].numpy(), r_mask),
                "prompt_length": int(p_mask.sum()),
                "response_length": int(r_mask.sum()),
                "num_turns": int(nt["__num_turns__"][i]),
                "status": str(nt["status"][i]),
                "error": nt["error"][i],
                "reward": None
                if scores is None or not np.isfinite(scores[i])
                else float(scores[i]),
            }
            f.write(json.dumps(row) + "\n")


def _tensors(output: DataProto) -> Any:
    if output.batch is None:
        raise ValueError("rollout output has no tensor batch")
    return output.batch


def _jsonable(v: Any) -> Any:
    return v.item() if isinstance(v, np.generic) else v


def summarize(output: DataProto, wall: float, num_samples: int) -> dict[str, Any]:
    """Throughput and length statistics of a finished rollout."""
    b = _tensors(output)
    p_len = b["prompts"].shape[1]
    attn = b["attention_mask"]
    resp = attn[:, p_len:].sum(-1).numpy()
    prompt = attn[:, :p_len].sum(-1).numpy()
    turns = np.asarray(output.non_tensor_batch["__num_turns__"], dtype=np.float64)
    statuses: dict[str, int] = {}
    for s in output.non_tensor_batch["status"].tolist():
        statuses[str(s)] = statuses.get(str(s), 0) + 1
    sampled = int(b["response_mask"].sum())
    scores = row_scores(output)
    scored = scores[np.isfinite(scores)] if scores is not None else np.zeros(0)
    return {
        "num_samples": num_samples,
        "num_trajectories": len(output),
        "wall_time_s": round(wall, 3),
        "reward": (
            {
                "mean": float(scored.mean()), "min": float(scored.min()),
                "max": float(scored.max()), "rows_scored": len(scored),
            }
            if len(scored)
            else None
        ),
        # per environment (env_agent rows: the ``env`` column), null without one
        "reward_by_env": rewards_by(output, "env"),
        # the tokens the policy sampled (response_mask 1): the console's tok/s
        "sampled_tokens": sampled,
        "sampled_tokens_per_s": round(sampled / wall, 1) if wall > 0 else None,
        # all response tokens, tool results and other inserted turns included
        "response_tokens": int(resp.sum()),
        "response_tokens_per_s": round(float(resp.sum()) / wall, 1) if wall > 0 else None,
        "prompt_length": {"mean": float(prompt.mean()), "max": int(prompt.max())},
        "response_length": {
            "mean": float(resp.mean()), "min": int(resp.min()), "max": int(resp.max()),
        },
        "num_turns": {"mean": float(turns.mean()), "max": int(turns.max())},
        "status": statuses,
        "timing_last_batch": {
            k: round(float(v), 4) for k, v in output.meta_info.get("timing", {}).items()
        },
    }


def run_rollout(cfg: DictConfig, *, show: int = 2, verbose: bool = False) -> int:
    """Roll out ``data.train_files``, write the three output files and return the exit code.

    Everything that can be checked without Ray (config keys and values, model path, every dataset
    row) is checked first and raises an :class:`~agentloop.errors.AgentLoopError`.  The result is
    :data:`EXIT_OK`, or :data:`EXIT_TOO_MANY_FAILURES` (reported on stderr) when more than
    ``rollout.agent.max_failure_fraction`` of the rows ended with status ``error`` or ``timeout``.

    Prints a summary table and ``show`` trajectories (:mod:`agentloop.cli.summary`).  Unless
    ``verbose``, the engine's and Ray's logs go to ``<output_dir>/rollout.log`` instead of the
    console.
    """
    # fail on a bad model path / config before Ray or the engine start
    resolved = resolve_config(cfg)
    data = resolved.data
    if not data.train_files:
        raise ConfigError(
            "data.train_files is not set: pass data.train_files=path/to/data.parquet (or .jsonl)"
        )
    batch = load_dataset(
        str(data.train_files), prompt_key=data.prompt_key, n=resolved.sampling.n,
        max_samples=data.max_samples, image_key=data.image_key, video_key=data.video_key,
    )
    # every environment the env_agent rows name resolves (docs/environments.md), before Ray starts
    rows = batch_rows(batch.non_tensor_batch, resolved.agent.default_agent_loop)
    check_env_samples(rows, resolved.env)
    check_selfplay_samples(rows, resolved.env)
    out_dir = Path(str(cfg.output_dir)).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_report(out_dir)
    if resolved.agent.record_timing is None:  # on for `agentloop report`
        OmegaConf.update(cfg, "actor_rollout_ref.rollout.agent.record_timing", True, force_add=True)
    # `agentloop verify` reads the sampling settings from it
    OmegaConf.save(cfg, out_dir / "config.yaml")
    output, wall = _generate(cfg, batch, None if verbose else out_dir / "rollout.log")
    output.save_to_disk(str(out_dir / "rollout.dataproto"))
    tokenizer = tokenizer_loader.load_tokenizer(resolved.model_config)
    write_trajectories(output, tokenizer, out_dir / "trajectories.jsonl")
    summary = summarize(output, wall, len(batch))
    nt = output.non_tensor_batch
    verdict = failure_verdict(nt["status"].tolist(), nt["error"].tolist(),
                              resolved.agent.max_failure_fraction)
    summary["failed_rows"] = verdict.num_failed
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    colour = use_colour()
    print("\n" + format_table(summary_rows(output, wall, len(batch)), colour))
    for n, row in enumerate(pick_rows(output, show)):
        print(
            f"\n--- trajectory {n + 1} (row {row}) ---\n"
            + render_trajectory(output, row, tokenizer, colour)
        )
    logs = "" if verbose else ", rollout.log"
    print(
        f"\noutputs: {out_dir.resolve()}/{{rollout.dataproto, trajectories.jsonl, "
        f"summary.json, config.yaml{logs}}}"
    )
    cli = cli_name()
    print(
        f"next: {cli} report {out_dir}    {cli} verify {out_dir} --model "
        f"{resolved.model_config.path}"
    )
    if verdict.message:
        print(f"agentloop: error: {verdict.message}", file=sys.stderr)
    return verdict.exit_code


def _remove_stale_report(out_dir: Path) -> None:
    """An earlier run's ``agentloop report`` output describes that run, not the one about to be
    written."""
    if (out_dir / "report.html").is_file():
        (out_dir / "report.html").unlink()
        shutil.rmtree(out_dir / "report", ignore_errors=True)


def cli_name() -> str:
    """How to call this CLI again: ``agentloop`` when it is on PATH, else its path (e.g.
    ``.venv/bin/agentloop`` in a virtualenv that is not activated)."""
    beside = Path(sys.executable).parent / "agentloop"
    if shutil.which("agentloop") or not beside.is_file():
        return "agentloop"
    try:
        return os.path.relpath(beside)
    except ValueError:
        return str(beside)


def _quiet_ray(log_file: Path) -> None:
    """Start Ray with the workers' output kept out of the console (it goes to ``log_file`` at the
    end)."""
    import ray  # heavy: Ray loads only once the input checks passed

    for key, value in {"VLLM_LOGGING_LEVEL": "ERROR", "TRANSFORMERS_VERBOSITY": "error",
                       "TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore"}.items():
        os.environ.setdefault(key, value)  # inherited by the Ray workers and the engine processes
    if not ray.is_initialized():
        ray.init(log_to_driver=False, logging_level=logging.ERROR, include_dashboard=False)
    os.environ.pop("TQDM_DISABLE", None)  # the driver's own progress bar stays
    log_file.write_text(
        "# agentloop rollout: engine and Ray worker logs (copied at the end of the run)\n"
    )


def _collect_logs(log_file: Path) -> None:
    """Append the Ray session's worker logs (stdout/stderr of every actor and engine process) to
    ``log_file``."""
    try:
        # heavy, and private to Ray: only when copying logs
        import ray._private.worker as ray_worker

        logs = Path(ray_worker._global_node.get_logs_dir_path())  # type: ignore[union-attr,attr-defined]
    except Exception:  # noqa: BLE001 - no session (Ray not started by us): nothing to copy
        return
    with log_file.open("a") as out:
        for path in sorted(logs.glob("worker-*")):
            text = path.read_text(errors="replace").strip()
            if text:
                out.write(f"\n===== {path.name} =====\n{text}\n")


def _generate(
    cfg: DictConfig, batch: DataProto, log_file: Path | None = None
) -> tuple[DataProto, float]:
    """Start the manager (Ray, servers, workers), roll out ``batch`` in ``data.train_batch_size``
    steps. ``log_file``: keep the workers' logs out of the console and copy them there."""
    # heavy (torch, Ray): imported only once the input checks passed
    from agentloop.batch.protocol import DataProto
    from agentloop.rollout.manager import AgentLoopManager

    if log_file is not None:
        _quiet_ray(log_file)
    manager = None
    try:
        manager = AgentLoopManager(cfg)
        t0 = time.perf_counter()
        step = max(1, manager.config.data.train_batch_size)
        parts: list[DataProto] = []
        tokens = 0
        with tqdm(total=len(batch), desc="rollout", unit="sample") as bar:
            for start in range(0, len(batch), step):
                part = manager.generate_sequences(batch.slice(start, start + step))
                parts.append(part)
                tokens += int(_tensors(part)["response_mask"].sum())
                bar.update(min(step, len(batch) - start))
                bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
        wall = time.perf_counter() - t0
    finally:
        if manager is not None:
            manager.shutdown()
        if log_file is not None:
            _collect_logs(log_file)
    timing = parts[-1].meta_info.get("timing", {})
    metrics = [m for p in parts for m in (p.meta_info.pop("metrics", None) or [])]
    for p in parts:  # per-batch values; DataProto.concat (verl's rules) refuses differing meta_info
        p.meta_info.pop("timing", None)
    output = DataProto.concat(parts)
    output.meta_info.update(timing=timing, metrics=metrics)
    return output, wall


def one_line(message: str) -> str:
    """An error message on one line: ``head:\n  a\n  b`` becomes ``head: a; b``."""
    text = re.sub(r":[ \t]*\n\s*", ": ", message.strip())
    return re.sub(r"\s*\n\s*", "; ", text)


def _agentloop_error(e: BaseException) -> AgentLoopError | None:
    """``e`` itself, or the agentloop error a Ray task error wraps (``RayTaskError.cause``); else
    None."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, AgentLoopError):
        return cause
    return e if isinstance(e, AgentLoopError) else None


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``agentloop``; exits 0, 1 (unexpected exception, with traceback), 2 (bad
    input: one line ``agentloop: error: ...`` on stderr) or 3 (too many failed rows; see
    :mod:`agentloop.cli.failures`)."""
    parser = argparse.ArgumentParser(prog="agentloop", description="Ray-native agentic rollouts")
    sub = parser.add_subparsers(dest="command", required=True)
    ro = sub.add_parser(
        "rollout",
        help="roll out a dataset (Hydra-style key=value overrides)",
        description="Exit codes: 0 done; 1 unexpected exception; 2 bad input (config, "
        "dataset, model path); "
        "3 more than rollout.agent.max_failure_fraction of the rows failed (outputs are "
        "still written).",
    )
    ro.add_argument(
        "--config",
        action="append",
        metavar="FILE.yaml",
        help="YAML merged over the defaults before the overrides; repeat it to "
        "layer several, in order",
    )
    ro.add_argument(
        "--show", type=int, default=2, help="trajectories to print at the end (default 2)"
    )
    ro.add_argument(
        "--verbose", action="store_true",
        help="show the engine's and Ray's logs on the console (default: <output_dir>/rollout.log)",
    )
    ro.add_argument("overrides", nargs="*", help="key=value config overrides")
    add_port_parser(sub)
    add_report_parser(sub)
    add_verify_parser(sub)
    args = parser.parse_args(argv)
    commands = {"port": run_port, "report": run_report, "verify": run_verify}
    try:
        code = (
            commands[args.command](args)
            if args.command in commands
            else run_rollout(
                build_config(args.config, args.overrides), show=args.show, verbose=args.verbose
            )
        )
    except Exception as e:
        error = _agentloop_error(e)
        if error is None:
            raise  # a bug or a crash: keep the traceback (exit 1)
        print(f"agentloop: error: {one_line(str(error))}", file=sys.stderr)
        code = EXIT_BAD_INPUT
    raise SystemExit(code)


if __name__ == "__main__":
    main()
