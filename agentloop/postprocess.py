"""The documented import path of :mod:`agentloop.batch.postprocess` (re-exports only)."""

from agentloop.batch.postprocess import (  # noqa: F401
    EPISODE_COLUMNS,
    episode_columns,
    fill_rows,
    pad_rows,
    postprocess,
)

__all__ = [
    "EPISODE_COLUMNS", "episode_columns", "fill_rows", "pad_rows", "postprocess",
]
