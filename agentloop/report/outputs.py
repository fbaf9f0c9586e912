"""Reading what ``agentloop rollout`` wrote: the saved DataProto of an output directory, as per-row
arrays.

:func:`load_rollout` checks the directory and the file before anything else and raises
:class:`~agentloop.errors.DatasetError` (the CLI's exit 2, one line) saying what is missing and how
to produce it.  :func:`rollout_table` turns the DataProto into the per-trajectory values the report
plots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from agentloop.errors import DatasetError, first_line
from agentloop.report.timing import GENERATE_CALLS

if TYPE_CHECKING:
    from agentloop.batch.protocol import DataProto

ROLLOUT_FILE = "rollout.dataproto"
REQUIRED_TENSORS = ("prompts", "responses", "attention_mask", "response_mask")
HOW_TO_PRODUCE = (
    "run `agentloop rollout --config CONFIG.yaml output_dir=DIR` first (it "
    "writes DIR/rollout.dataproto)"
)


def rollout_path(output_dir: str | Path) -> Path:
    """``output_dir/rollout.dataproto``, after checking that both exist."""
    directory = Path(output_dir).expanduser()
    if not directory.is_dir():
        raise DatasetError(
            f"output directory {str(output_dir)!r} does not exist: pass the "
            f"output_dir of an "
            f"`agentloop rollout` run, or {HOW_TO_PRODUCE}"
        )
    path = directory / ROLLOUT_FILE
    if not path.is_file():
        found = sorted(p.name for p in directory.iterdir())[:8]
        raise DatasetError(
            f"{directory} has no {ROLLOUT_FILE} (found: {found or 'nothing'}): {HOW_TO_PRODUCE}"
        )
    return path


def load_rollout(output_dir: str | Path) -> DataProto:
    """The DataProto saved in ``output_dir``; DatasetError when it is missing, unreadable or lacks
    the rollout tensors (``prompts``, ``responses``, ``attention_mask``, ``response_mask``)."""
    path = rollout_path(output_dir)
    # heavy (torch): the CLI imports this module for every command
    from agentloop.batch.protocol import DataProto

    try:
        data = DataProto.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - torch.load / pickle raise many types on a bad file
        raise DatasetError(
            f"{path} is not a saved DataProto ({first_line(e)}): {HOW_TO_PRODUCE}"
        ) from e
    keys = set(data.batch.keys()) if data.batch is not None else set()
    missing = [k for k in REQUIRED_TENSORS if k not in keys]
    if missing:
        raise DatasetError(
            f"{path} lacks the rollout tensors {missing} (has "
            f"{sorted(keys)}): it is not the output "
            f"of a rollout; {HOW_TO_PRODUCE}"
        )
    if len(data) == 0:
        raise DatasetError(
            f"{path} holds no trajectories: {HOW_TO_PRODUCE} with a non-empty dataset"
        )
    return data


@dataclass
class RolloutTable:
    """One entry per trajectory (row) of a rollout, in row order."""

    response_length: np.ndarray
    """Response tokens (sampled and tool / user turns)."""
    sampled_tokens: np.ndarray
    """Tokens the policy sampled (``response_mask`` 1)."""
    num_turns: np.ndarray
    status: list[str]
    tool_calls: np.ndarray | None
    """``num_tool_calls`` per row (tool-calling loops); None when the rollout has no such column."""
    reward: np.ndarray | None
    """``rm_scores.sum(-1)``, NaN on rows without a valid reward; None when the rollout has no
    rewards."""
    calls: list[dict[str, Any]] = field(default_factory=list)
    """Every recorded generate call (:mod:`agentloop.report.timing`), each with its ``row``."""
    env: list[str | None] | None = None
    """The ``env`` column per row (``env_agent`` / self-play rows: the environment's name, None
    on other rows); None when the rollout has no such column."""

    def __len__(self) -> int:
        return len(self.status)


def rollout_table(data: DataProto) -> RolloutTable:
    """The per-row values of a loaded rollout (see :class:`RolloutTable`)."""
    assert data.batch is not None
    b, nt = data.batch, data.non_tensor_batch
    p_len = b["prompts"].shape[1]
    response_length = b["attention_mask"][:, p_len:].sum(-1).numpy()
    sampled = b["response_mask"].sum(-1).numpy()
    n = len(data)
    turns = (
        np.asarray(nt["__num_turns__"], dtype=np.int64)
        if "__num_turns__" in nt
        else np.zeros(n, np.int64)
    )
    status = [str(s) for s in nt["status"].tolist()] if "status" in nt else ["unknown"] * n
    tool_calls = None
    if "num_tool_calls" in nt:
        tool_calls = np.array(
            [int(v) if v is not None else 0 for v in nt["num_tool_calls"].tolist()], np.int64
        )
    reward = None
    if "rm_scores" in b:
        reward = b["rm_scores"].float().sum(-1).numpy().astype(np.float64)
        if "reward_valid" in b:
            reward[b["reward_valid"].numpy() == 0] = np.nan
    calls: list[dict[str, Any]] = []
    if GENERATE_CALLS in nt:
        for row, row_calls in enumerate(nt[GENERATE_CALLS].tolist()):
            calls.extend({**c, "row": row} for c in row_calls or [])
    env = None
    if "env" in nt:
        env = [None if v is None else str(v) for v in nt["env"].tolist()]
    return RolloutTable(
        response_length=response_length, sampled_tokens=sampled, num_turns=turns, status=status,
        tool_calls=tool_calls, reward=reward, calls=calls, env=env,
    )
