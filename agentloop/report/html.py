"""``agentloop report``: plots and one HTML page for a rollout's output directory.

:func:`write_report` reads ``OUTPUT_DIR/rollout.dataproto`` (and ``summary.json`` when present),
writes one PNG per plot of :data:`agentloop.report.plots.PLOTS` under ``OUTPUT_DIR/report/`` and
``OUTPUT_DIR/report.html``, which shows a summary table, the timeline numbers and the plots
(referenced relatively, so the directory can be copied or served as it is; ``embed=True`` inlines
them as base64 for a single self-contained file).
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

import numpy as np

from agentloop.report.outputs import RolloutTable, load_rollout, rollout_table
from agentloop.report.plots import Plot, timeline_stats, write_plots

REPORT_HTML = "report.html"
PLOT_DIR = "report"

_STYLE = """body{font-family:sans-serif;margin:2em;max-width:1100px}
table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;font-size:14px}
img{max-width:100%;border:1px solid #eee}
.note{color:#a60;font-size:13px}
figure{margin:1.5em 0}"""


def summary_rows(table: RolloutTable, summary: dict[str, Any]) -> dict[str, Any]:
    """The page's summary table: counts and means over the trajectories, plus throughput from
    summary.json."""
    rows: dict[str, Any] = {
        "samples": summary.get("num_samples", "?"),
        "trajectories": len(table),
        "status": ", ".join(
            f"{k}: {v}" for k, v in sorted(_counts(table.status).items(), key=lambda kv: -kv[1])
        ),
        "mean turns": round(float(table.num_turns.mean()), 2),
        "mean response length (tokens)": round(float(table.response_length.mean()), 1),
        "mean sampled tokens": round(float(table.sampled_tokens.mean()), 1),
    }
    if table.tool_calls is not None:
        rows["tool-call rate (trajectories with a tool call)"] = round(
            float((table.tool_calls > 0).mean()), 3
        )
        rows["mean tool calls"] = round(float(table.tool_calls.mean()), 2)
    if table.reward is not None and not np.isnan(table.reward).all():
        rows["mean reward"] = round(float(np.nanmean(table.reward)), 4)
    for key in ("wall_time_s", "sampled_tokens_per_s", "response_tokens_per_s"):
        if key in summary:
            rows[key.replace("_", " ")] = summary[key]
    return rows


NO_ENV = "(no env)"
"""The group of rows without an environment in a rollout where others have one."""


def env_rows(table: RolloutTable) -> dict[str, dict[str, Any]]:
    """Per environment (the ``env`` column of ``env_agent`` / self-play rows, sorted by name; rows
    without one as :data:`NO_ENV`): trajectories, mean reward over the rows with a valid reward
    (None when none has one), status counts, mean turns. Empty when no row names an environment."""
    if table.env is None or all(e is None for e in table.env):
        return {}
    groups: dict[str, list[int]] = {}
    for row, env in enumerate(table.env):
        groups.setdefault(NO_ENV if env is None else env, []).append(row)
    out: dict[str, dict[str, Any]] = {}
    for env in sorted(groups):
        rows = groups[env]
        rewards = table.reward[rows] if table.reward is not None else np.zeros(0)
        scored = rewards[~np.isnan(rewards)]
        statuses = _counts([table.status[r] for r in rows])
        out[env] = {
            "trajectories": len(rows),
            "mean reward": round(float(scored.mean()), 4) if len(scored) else None,
            "status": ", ".join(
                f"{k}: {v}" for k, v in sorted(statuses.items(), key=lambda kv: -kv[1])
            ),
            "mean turns": round(float(table.num_turns[rows].mean()), 2),
        }
    return out


def _counts(values: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def _table(rows: dict[str, Any]) -> str:
    cells = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_text(v))}</td></tr>"
        for k, v in rows.items()
    )
    return f"<table>{cells}</table>"


def _grouped_table(groups: dict[str, dict[str, Any]], key: str) -> str:
    """One row per group, one column per value (the columns of the first group)."""
    columns = list(next(iter(groups.values())))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in [key, *columns])
    body = "".join(
        f"<tr><th>{html.escape(name)}</th>"
        + "".join(f"<td>{html.escape(_text(values[c]))}</td>" for c in columns)
        + "</tr>"
        for name, values in groups.items()
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _text(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items())
    return str(value)


def _image(plot: Plot, page_dir: Path, embed: bool) -> str:
    if embed:
        src = "data:image/png;base64," + base64.b64encode(plot.path.read_bytes()).decode()
    else:
        src = plot.path.relative_to(page_dir).as_posix()
    note = f'<div class="note">{html.escape(plot.note)}</div>' if plot.note else ""
    return (f'<figure id="{plot.name}"><figcaption><b>{html.escape(plot.title)}</b></figcaption>'
            f'<img src="{html.escape(src)}" alt="{html.escape(plot.title)}">{note}</figure>')


def render_html(output_dir: Path, rows: dict[str, Any], timeline: dict[str, Any], plots: list[Plot],
                embed: bool = False, by_env: dict[str, dict[str, Any]] | None = None) -> str:
    """The report page for ``output_dir``; ``by_env`` (:func:`env_rows`) adds the "By
    environment" table when not empty."""
    title = f"agentloop rollout report: {output_dir.resolve().name}"
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
        f"<p>{html.escape(str(output_dir.resolve()))}</p><h2>Summary</h2>", _table(rows),
    ]
    if by_env:
        parts += ["<h2>By environment</h2>", _grouped_table(by_env, "environment")]
    if timeline:
        parts += ["<h2>Generate calls</h2>", _table(timeline)]
    parts += ["<h2>Plots</h2>", *(_image(p, output_dir, embed) for p in plots), "</body></html>"]
    return "\n".join(parts)


def write_report(output_dir: str | Path, embed: bool = False) -> Path:
    """Write the plots and ``report.html`` for the rollout saved in ``output_dir``; returns the
    page's path.

    Raises:
        DatasetError: ``output_dir`` or its ``rollout.dataproto`` is missing or not a rollout.
    """
    directory = Path(output_dir).expanduser()
    table = rollout_table(load_rollout(directory))
    summary_file = directory / "summary.json"
    try:
        summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    except ValueError:
        summary = {}
    plots = write_plots(table, directory / PLOT_DIR)
    page = directory / REPORT_HTML
    page.write_text(
        render_html(
            directory, summary_rows(table, summary), timeline_stats(table.calls), plots, embed,
            by_env=env_rows(table),
        )
    )
    return page
