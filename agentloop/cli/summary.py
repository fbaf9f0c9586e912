"""What ``agentloop rollout`` prints when it is done: a summary table and a few trajectories,
readable at a glance.

:func:`summary_rows` computes the numbers (samples, trajectories, mean reward, tool-call rate,
turns, status counts, tokens/s) from the padded rollout; :func:`format_table` lays them out;
:func:`render_trajectory` shows one row as a human reads it: the prompt, then the response with the
tokens the policy sampled (mask
1) apart from the tokens the loop inserted (tool results, user turns: mask 0) -- colours on a
terminal, ``[tool] ...`` / ``[model] ...`` markers otherwise -- and the reward.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from agentloop.batch.protocol import DataProto

_DIM, _GREEN, _CYAN, _BOLD, _RESET = "\033[2m", "\033[32m", "\033[36m", "\033[1m", "\033[0m"


def use_colour(stream: Any = None) -> bool:
    """Colours only on a terminal, and never with ``NO_COLOR`` set."""
    stream = stream if stream is not None else sys.stdout
    return bool(getattr(stream, "isatty", lambda: False)()) and "NO_COLOR" not in os.environ


def row_scores(output: DataProto) -> np.ndarray | None:
    """Each row's reward (its ``rm_scores`` summed; NaN where ``reward_valid`` says it has none), or
    None without ``rm_scores``."""
    batch = output.batch
    if batch is None or "rm_scores" not in set(batch.keys()):
        return None
    scores = batch["rm_scores"].sum(-1).numpy().astype(np.float64)
    valid = output.non_tensor_batch.get("reward_valid")
    if valid is None and "reward_valid" in set(batch.keys()):
        valid = batch["reward_valid"].numpy()
    if valid is not None:
        scores = np.where(np.asarray(valid).astype(bool), scores, np.nan)
    return scores


def rewards_by(output: DataProto, column: str) -> dict[str, dict[str, Any]] | None:
    """Per value of the non-tensor ``column`` (e.g. ``env``, ``agent_name``): the mean reward and
    the number of rows scored; None without the column or without ``rm_scores``."""
    values = output.non_tensor_batch.get(column)
    scores = row_scores(output)
    if values is None or scores is None:
        return None
    groups: dict[str, list[float]] = {}
    for value, score in zip(values.tolist(), scores.tolist(), strict=True):
        if value is not None and np.isfinite(score):
            groups.setdefault(str(value), []).append(float(score))
    return {
        k: {"mean": float(np.mean(v)), "rows_scored": len(v)} for k, v in sorted(groups.items())
    }


def _tool_turns(output: DataProto) -> np.ndarray:
    """Per row: how many tool calls it made (``num_tool_calls``), else how many mask-0 runs its
    response has."""
    calls = output.non_tensor_batch.get("num_tool_calls")
    if calls is not None:
        return np.array([int(c or 0) for c in calls.tolist()])
    mask = output.batch["response_mask"].numpy()  # type: ignore[index]
    attn = output.batch["attention_mask"].numpy()[:, -mask.shape[1]:]  # type: ignore[index]
    inserted = (mask == 0) & (attn == 1)
    starts = inserted & ~np.concatenate([np.zeros((len(mask), 1), bool), inserted[:, :-1]], axis=1)
    return starts.sum(-1)


def summary_rows(output: DataProto, wall: float, num_samples: int) -> list[tuple[str, str]]:
    """The table's (name, value) rows."""
    batch = output.batch
    assert batch is not None
    nt = output.non_tensor_batch
    sampled = int(batch["response_mask"].sum())
    turns = np.asarray(nt["__num_turns__"], dtype=np.float64)
    tools = _tool_turns(output)
    statuses: dict[str, int] = {}
    for status in nt["status"].tolist():
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    rows = [("samples", str(num_samples)), ("trajectories", str(len(output)))]
    scores = row_scores(output)
    if scores is not None and np.isfinite(scores).any():
        rows.append(
            (
                "mean reward",
                f"{np.nanmean(scores):.3f} ({int(np.isfinite(scores).sum())} rows scored)",
            )
        )
    by_env = rewards_by(output, "env")
    if by_env:
        rows.append(("reward by env", ", ".join(
            f"{name} {g['mean']:.3f} ({g['rows_scored']})" for name, g in by_env.items())))
    rows += [
        (
            "tool-call rate",
            f"{float((tools > 0).mean()):.0%} of trajectories ({int(tools.sum())} calls)",
        ),
        ("turns", f"mean {turns.mean():.1f}, max {int(turns.max()) if len(turns) else 0}"),
        (
            "status",
            ", ".join(f"{k} {v}" for k, v in sorted(statuses.items(), key=lambda kv: -kv[1])),
        ),
        (
            "sampled tokens",
            f"{sampled} in {wall:.1f}s = {sampled / wall:.0f} tok/s" if wall > 0 else str(sampled),
        ),
    ]
    return rows


def format_table(rows: list[tuple[str, str]], colour: bool = False) -> str:
    width = max(len(name) for name, _ in rows)
    bold, reset = (_BOLD, _RESET) if colour else ("", "")
    return "\n".join(f"  {bold}{name:<{width}}{reset}  {value}" for name, value in rows)


def render_trajectory(output: DataProto, row: int, tokenizer: Any, colour: bool = False) -> str:
    """Row ``row``: the prompt's last message, the response split into sampled (model) and inserted
    (tool / user) runs, the status and the reward."""
    batch = output.batch
    assert batch is not None
    p_len = batch["prompts"].shape[1]
    attn = batch["attention_mask"][row].numpy()
    prompt = batch["prompts"][row].numpy()[attn[:p_len].astype(bool)]
    length = int(attn[p_len:].sum())
    ids = batch["responses"][row].numpy()[:length]
    mask = batch["response_mask"][row].numpy()[:length]
    prompt_text = tokenizer.decode(prompt.tolist(), skip_special_tokens=False)
    last = prompt_text.rsplit("<|im_start|>user", 1)[-1]
    last = last.rsplit("<|im_start|>assistant", 1)[0].replace("<|im_end|>", "").strip()
    lines = [f"prompt (last user turn): {last[-300:]}"]
    start = 0
    for end in [*(np.flatnonzero(np.diff(mask)) + 1).tolist(), length]:
        if end <= start:
            continue
        text = tokenizer.decode(ids[start:end].tolist(), skip_special_tokens=False).strip()
        model = bool(mask[start])
        tag = "[model]" if model else "[tool] "
        if colour:
            lines.append(f"{_GREEN if model else _CYAN}{tag} {text}{_RESET}")
        else:
            lines.append(f"{tag} {text}")
        start = end
    scores = row_scores(output)
    reward = "" if scores is None or not np.isfinite(scores[row]) else f", reward {scores[row]:g}"
    status = output.non_tensor_batch["status"][row]
    lines.append(
        f"{_DIM if colour else ''}status {status}{reward}; [model] = sampled by "
        f"the policy (mask 1), "
        f"[tool] = inserted by the loop (mask 0){_RESET if colour else ''}"
    )
    return "\n".join(lines)


def pick_rows(output: DataProto, count: int) -> list[int]:
    """Up to ``count`` rows worth showing: rows with a tool call first (the interesting ones), one
    per prompt (``uid``), preferring rewards not seen yet (a right and a wrong answer), then the
    rest."""
    tools = _tool_turns(output)
    scores = row_scores(output)
    uids = output.non_tensor_batch.get("uid")
    order = [i for i in range(len(output)) if tools[i] > 0] + [
        i for i in range(len(output)) if tools[i] == 0
    ]
    picked: list[int] = []
    for new_reward_only in (True, False):
        for i in order:
            if len(picked) >= count or i in picked:
                continue
            if uids is not None and any(uids[j] == uids[i] for j in picked) and new_reward_only:
                continue
            if new_reward_only and scores is not None and picked and any(
                    scores[j] == scores[i] for j in picked):
                continue
            picked.append(i)
    return picked
