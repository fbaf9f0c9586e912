"""The report's plots, drawn with matplotlib (``matplotlib.figure.Figure`` + ``savefig``: the Agg
renderer, no pyplot and no global backend state) from a
:class:`~agentloop.report.outputs.RolloutTable`.

Every plot is written as a PNG; a plot whose data the rollout did not record (no rewards, no
tool-call counts, no per-request timing) is still drawn, with a line saying what is missing and how
to get it, so the page keeps its layout.
"""

from __future__ import annotations

import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agentloop.report.outputs import RolloutTable

DPI = 100
_STOP_COLOURS = {"stop": "tab:blue", "length": "tab:orange", "aborted": "tab:red"}


@dataclass
class Plot:
    """One PNG of the report."""

    name: str
    title: str
    path: Path
    note: str | None = None
    """Why the plot is empty or partial, if it is."""


def _figure(width: float = 6.4, height: float = 3.6) -> tuple[Any, Any]:
    from matplotlib.figure import Figure  # heavy (~0.3 s): only when plotting

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    return fig, fig.subplots()


def _empty(ax: Any, note: str) -> None:
    ax.text(
        0.5, 0.5, textwrap.fill(note, 70), ha="center", va="center", transform=ax.transAxes,
        fontsize=9,
    )
    ax.set_xticks([])
    ax.set_yticks([])


def _int_bars(ax: Any, values: np.ndarray, colour: str) -> None:
    counts = Counter(int(v) for v in values)
    keys = sorted(counts)
    ax.bar(keys, [counts[k] for k in keys], color=colour, width=0.8)
    ax.set_xticks(keys if len(keys) <= 20 else keys[:: max(1, len(keys) // 20)])
    ax.set_ylabel("trajectories")


def response_lengths(table: RolloutTable, ax: Any) -> str | None:
    """Histogram of response lengths: all response tokens and the sampled ones (mask 1)."""
    bins = np.histogram_bin_edges(
        np.concatenate([table.response_length, table.sampled_tokens]), bins=30
    )
    ax.hist(
        table.response_length, bins=bins, alpha=0.6, label="response (sampled + tool/user turns)"
    )
    ax.hist(table.sampled_tokens, bins=bins, alpha=0.6, label="sampled (response_mask 1)")
    ax.set_xlabel("tokens")
    ax.set_ylabel("trajectories")
    ax.legend(fontsize=8)
    return None


def turns(table: RolloutTable, ax: Any) -> str | None:
    """Number of turns per trajectory (verl's count: the prompt is one turn)."""
    _int_bars(ax, table.num_turns, "tab:green")
    ax.set_xlabel("turns (__num_turns__)")
    return None


def tool_calls(table: RolloutTable, ax: Any) -> str | None:
    """Tool calls per trajectory (``num_tool_calls``)."""
    if table.tool_calls is None:
        note = (
            "no num_tool_calls column: this rollout's agent loop does not call tools "
            "(use tool_agent)"
        )
        _empty(ax, note)
        return note
    _int_bars(ax, table.tool_calls, "tab:purple")
    ax.set_xlabel("tool calls per trajectory")
    return None


def statuses(table: RolloutTable, ax: Any) -> str | None:
    """How the trajectories ended."""
    counts = Counter(table.status).most_common()
    names = [k for k, _ in counts][::-1]
    values = [v for _, v in counts][::-1]
    bars = ax.barh(names, values, color="tab:gray")
    ax.bar_label(bars, padding=2, fontsize=8)
    ax.set_xlabel("trajectories")
    return None


def reward_by_turns(table: RolloutTable, ax: Any) -> str | None:
    """Mean reward per number of turns, with each trajectory's reward as a dot and the count
    above the bar."""
    if table.reward is None or np.isnan(table.reward).all():
        note = (
            "no rewards in this rollout (rm_scores): set custom_reward_function.path "
            "(and .name) or use a loop "
            "that sets reward_score"
        )
        _empty(ax, note)
        return note
    ok = ~np.isnan(table.reward)
    keys = sorted({int(t) for t in table.num_turns[ok]})
    means = [float(table.reward[ok & (table.num_turns == k)].mean()) for k in keys]
    counts = [int((ok & (table.num_turns == k)).sum()) for k in keys]
    bars = ax.bar(keys, means, color="tab:olive", alpha=0.7, width=0.8)
    ax.bar_label(bars, labels=[f"n={c}" for c in counts], padding=2, fontsize=8)
    jitter = np.random.default_rng(0).uniform(-0.25, 0.25, int(ok.sum()))
    ax.scatter(table.num_turns[ok] + jitter, table.reward[ok], s=8, color="black", alpha=0.5)
    ax.set_xticks(keys)
    ax.set_xlabel("turns (__num_turns__)")
    ax.set_ylabel("reward")
    skipped = int((~ok).sum())
    return f"{skipped} trajectories without a valid reward are left out" if skipped else None


def lanes(intervals: list[tuple[float, float]]) -> list[int]:
    """A lane per interval so that intervals in one lane do not overlap (greedy, by start time)."""
    order = sorted(range(len(intervals)), key=lambda i: intervals[i][0])
    ends: list[float] = []
    out = [0] * len(intervals)
    for i in order:
        start, end = intervals[i]
        lane = next((j for j, e in enumerate(ends) if e <= start), len(ends))
        if lane == len(ends):
            ends.append(end)
        else:
            ends[lane] = end
        out[i] = lane
    return out


def server_timeline(table: RolloutTable, ax: Any) -> str | None:
    """One band per server, one bar per generate call (concurrent calls stacked in lanes), coloured
    by stop reason; the dashed line marks when 90% of the calls had finished, so the tail is what
    lies right of it."""
    if not table.calls:
        note = (
            "no per-request timing (generate_calls column) in this rollout: it was "
            "written by an agentloop "
            "version that did not record it; run the rollout again"
        )
        _empty(ax, note)
        return note
    t0 = min(c["start"] for c in table.calls)
    servers = sorted({int(c["server"]) for c in table.calls})
    for band, server in enumerate(servers):
        calls = [c for c in table.calls if int(c["server"]) == server]
        spans = [(c["start"] - t0, c["end"] - t0) for c in calls]
        lane_of = lanes(spans)
        height = 0.9 / max(1, max(lane_of) + 1)
        # one artist per lane and colour
        bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for call, (start, end), lane in zip(calls, spans, lane_of, strict=True):
            colour = _STOP_COLOURS.get(str(call.get("stop_reason")), "tab:gray")
            bars.setdefault((lane, colour), []).append((start, max(end - start, 1e-3)))
        for (lane, colour), xranges in bars.items():
            ax.broken_barh(xranges, (band - 0.45 + lane * height, height * 0.9), facecolors=colour)
    ends = np.array([c["end"] - t0 for c in table.calls])
    ax.axvline(float(np.percentile(ends, 90)), color="black", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(servers)), [f"server {s}" for s in servers])
    ax.set_xlabel("seconds since the first call")
    # heavy (~0.3 s): only when plotting
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[Any] = [Patch(color=c, label=k) for k, c in _STOP_COLOURS.items()]
    handles.append(
        Line2D([], [], color="black", linestyle="--", linewidth=1, label="90% of calls done")
    )
    ax.legend(handles=handles, fontsize=7, loc="upper right")
    return None


PLOTS = (
    ("response_length", "Response length", response_lengths),
    ("turns", "Turns per trajectory", turns),
    ("tool_calls", "Tool calls per trajectory", tool_calls), ("status", "Status", statuses),
    ("reward_by_turns", "Reward by number of turns", reward_by_turns),
    ("server_timeline", "Generate calls per server (timeline)", server_timeline),
)


def write_plots(table: RolloutTable, directory: Path) -> list[Plot]:
    """Draw every plot of :data:`PLOTS` into ``directory/<name>.png``; returns them in page
    order."""
    directory.mkdir(parents=True, exist_ok=True)
    plots = []
    for name, title, draw in PLOTS:
        servers = len({c["server"] for c in table.calls})
        fig, ax = (
            _figure(10.0, 1.2 + 1.1 * max(1, servers)) if name == "server_timeline" else _figure()
        )
        note = draw(table, ax)
        ax.set_title(title, fontsize=10)
        path = directory / f"{name}.png"
        fig.savefig(path)
        plots.append(Plot(name=name, title=title, path=path, note=note))
    return plots


def timeline_stats(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """Numbers behind the timeline: calls, span, call durations, and the tail (time from 90% of the
    calls done to the last one done); empty without calls."""
    if not calls:
        return {}
    t0 = min(c["start"] for c in calls)
    ends = np.array([c["end"] - t0 for c in calls])
    durations = np.array([c["end"] - c["start"] for c in calls])
    per_server = Counter(int(c["server"]) for c in calls)
    p90 = float(np.percentile(ends, 90))
    return {
        "generate_calls": len(calls),
        "calls_per_server": {f"server {k}": v for k, v in sorted(per_server.items())},
        "span_s": round(float(ends.max()), 3),
        "call_s_p50": round(float(np.percentile(durations, 50)), 3),
        "call_s_p99": round(float(np.percentile(durations, 99)), 3),
        "call_s_max": round(float(durations.max()), 3),
        "tail_s": round(float(ends.max()) - p90, 3),
        "tail_fraction": round((float(ends.max()) - p90) / float(ends.max()), 3)
        if ends.max() > 0
        else 0.0,
    }
