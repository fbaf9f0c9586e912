"""A batch's samples as the worker reads them: the batch check, agent names, trajectory info.

:func:`check_batch` is the one batch check (the manager runs it before anything is dispatched);
:func:`agent_names` and :func:`trajectory_info` are what each sample's loop is told about itself.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from agentloop.batch.protocol import DataProto
from agentloop.errors import DatasetError
from agentloop.loops.base import ResolvedAgentLoop, lookup


def trajectory_info(index: np.ndarray, step: int, validate: bool) -> list[dict[str, Any]]:
    """verl's trajectory info: ``rollout_n`` counts earlier rows with the same sample index."""
    seen: Counter = Counter()
    out = []
    for idx in index.tolist():
        out.append(
            {"step": step, "sample_index": idx, "rollout_n": seen[idx], "validate": validate}
        )
        seen[idx] += 1
    return out


def agent_names(batch: DataProto, default_agent: str) -> np.ndarray:
    """The per-sample agent names: ``agent_name``, ``default_agent`` where the column or the
    value is absent."""
    given = batch.non_tensor_batch.get("agent_name")
    names = np.empty(len(batch), dtype=object)
    values = given.tolist() if given is not None else [None] * len(batch)
    names[:] = [str(n) if n else default_agent for n in values]
    return names


def check_batch(
    batch: DataProto, registry: dict[str, ResolvedAgentLoop], default_agent: str
) -> np.ndarray:
    """Fail before any generation if ``raw_prompt`` is missing or an ``agent_name`` is unknown.

    Returns the per-sample agent names (:func:`agent_names`).

    Raises:
        DatasetError: no ``raw_prompt`` column.
        UnknownAgentError: an ``agent_name`` is not registered (the message lists the registered
            names).
    """
    if "raw_prompt" not in batch.non_tensor_batch:
        raise DatasetError(
            f"batch has no 'raw_prompt' column (non-tensor keys: "
            f"{sorted(batch.non_tensor_batch)}); "
            "each sample needs its chat messages under non_tensor_batch['raw_prompt']"
        )
    names = agent_names(batch, default_agent)
    for name in set(names.tolist()):
        lookup(registry, str(name))
    return names
