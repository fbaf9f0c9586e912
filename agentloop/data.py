"""The documented import path of :mod:`agentloop.batch.data` (re-exports only)."""

from agentloop.batch.data import (  # noqa: F401
    load_dataset,
    media_columns,
    prompt_problem,
    read_rows,
    repeat_for_rollout,
    rows_to_batch,
    validate_rows,
)

__all__ = [
    "load_dataset", "media_columns", "prompt_problem", "read_rows", "repeat_for_rollout",
    "rows_to_batch", "validate_rows",
]
