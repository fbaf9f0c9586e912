"""Routing replay (R3): the experts an MoE engine routed each token to, kept aligned with a
trajectory's tokens and padded into verl's ``routed_experts`` column.

A server's :class:`~agentloop.types.TokenOutput` carries ``routed_experts`` [n, num_layers, top_k]
for the positions ``routed_experts_start .. routed_experts_start + n`` of ``prompt_ids +
token_ids`` (the tokens the engine ran through the model: never the last sampled one).
:class:`RoutedExpertsTrace` keeps one trajectory's rows by position over its turns (a turn asks
only for the positions it does not know yet, :data:`PROMPT_START_KEY`); :func:`join_routed_experts`
joins the pieces of a generation a pause cut; :func:`pad_routed_experts` builds the batch column.
Layout, fill value and coverage: docs/porting-from-verl.md#routing-replay-r3.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from agentloop.errors import DatasetError
from agentloop.types import AgentLoopOutput, TokenOutput

ROUTED_EXPERTS_KEY = "routed_experts"
"""The batch column (verl's name): int16 [B, prompt_length + response_length, layers, top_k]."""
PROMPT_START_KEY = "routed_experts_prompt_start"
"""Sampling-param key (vLLM's ``SamplingParams`` field): skip the routing of the first N prompt
tokens, already known from earlier turns."""
FILL = 0
"""The value of cells with no routing: padding and tokens never run through the model (verl's)."""
DTYPE = np.int16
"""The column's dtype (verl's)."""


def as_rows(value: Any) -> np.ndarray:
    """``value`` (numpy array, torch tensor or nested list) as a numpy array [n, layers, top_k].

    Raises:
        DatasetError: it is not 3-dimensional.
    """
    rows = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
    if rows.ndim != 3:
        raise DatasetError(
            f"routed_experts must be [tokens, layers, top_k], got shape {tuple(rows.shape)}"
        )
    return rows


def merge_rows(known: np.ndarray | None, start: int, rows: np.ndarray) -> np.ndarray:
    """Rows by position: ``known`` (positions 0..len-1) kept, ``rows`` (positions ``start``..)
    appended past them; a gap between the two is :data:`FILL`.

    Earlier rows win: a token keeps the routing the engine used when it was first run (a resumed
    piece re-runs its prefix, possibly with newer weights).
    """
    if known is None or len(known) == 0:
        if start == 0:
            return rows
        known = np.zeros((0, *rows.shape[1:]), dtype=rows.dtype)
    end = len(known)
    if start + len(rows) <= end:
        return known
    if start > end:
        gap = np.full((start - end, *rows.shape[1:]), FILL, dtype=rows.dtype)
        return np.concatenate([known, gap, rows])
    return np.concatenate([known, rows[end - start:].astype(known.dtype, copy=False)])


def join_routed_experts(pieces: Sequence[TokenOutput]) -> dict[str, Any]:
    """``routed_experts`` / ``routed_experts_start`` of the pieces of one resumed generation
    (each piece's prompt is the previous one's plus its tokens); empty when none has routing."""
    with_rows = [p for p in pieces if p.routed_experts is not None]
    if not with_rows:
        return {}
    start = with_rows[0].routed_experts_start
    joined: np.ndarray | None = None
    for piece in with_rows:
        rows = as_rows(piece.routed_experts)
        joined = merge_rows(joined, piece.routed_experts_start - start, rows)
    return {"routed_experts": joined, "routed_experts_start": start}


class RoutedExpertsTrace:
    """One trajectory's routed experts by token position, over its generation calls.

    ``request(prompt_ids)`` before a call gives the sampling params that skip the known prefix;
    ``add(prompt_ids, output)`` after it records the call's rows; ``rows_for(prompt_ids,
    response_ids)`` gives the rows of a final ``prompt_ids + response_ids``.  Without routing in
    the outputs (the key off, a dense engine) it holds nothing and costs one ``None`` check per
    call.
    """

    def __init__(self) -> None:
        self.rows: np.ndarray | None = None
        """Routing of positions 0..len-1 of :attr:`tokens`."""
        self.tokens: list[int] = []
        """The tokens of the last call (its prompt and sampled ids)."""

    def request(self, prompt_ids: Sequence[int]) -> dict[str, int]:
        """``{PROMPT_START_KEY: n}`` when the first ``n`` >= 1 positions of ``prompt_ids`` are
        known; else ``{}`` (and a prompt that does not extend the known tokens starts afresh)."""
        if self.rows is None:
            return {}
        known = len(self.rows)
        if known > len(prompt_ids) or list(prompt_ids[:known]) != self.tokens[:known]:
            self.rows, self.tokens = None, []
            return {}
        return {PROMPT_START_KEY: known}

    def add(self, prompt_ids: Sequence[int], output: TokenOutput) -> None:
        """Record ``output``'s rows (positions from its ``routed_experts_start``) for
        ``prompt_ids + output.token_ids``."""
        if output.routed_experts is None:
            return
        rows = as_rows(output.routed_experts)
        self.rows = merge_rows(self.rows, output.routed_experts_start, rows)
        self.tokens = [*prompt_ids, *output.token_ids]

    def rows_for(
        self, prompt_ids: Sequence[int], response_ids: Sequence[int] = ()
    ) -> np.ndarray | None:
        """The known rows of ``prompt_ids + response_ids`` (a trajectory's tokens): those of the
        longest prefix they share with the recorded tokens; None when nothing was recorded (the
        key off: nothing is joined).  Tokens past them (e.g. a trailing tool turn no call ran) get
        :data:`FILL` when padded."""
        if self.rows is None:
            return None
        ids = [*prompt_ids, *response_ids]
        n = min(len(self.rows), len(ids))
        if list(ids[:n]) != self.tokens[:n]:
            n = next(i for i, (a, b) in enumerate(zip(ids, self.tokens, strict=False)) if a != b)
        return self.rows[:n]


def call_rows(
    output: Any, known: int, end: int
) -> tuple[int, np.ndarray] | None:
    """One generation call's rows as ``(start, rows)``, kept to the positions ``known .. end``
    (earlier rows win; ``end``: the length of the call's kept ``prompt_ids + token_ids``).

    Args:
        output: a :class:`~agentloop.types.TokenOutput` or last stream chunk
            (:class:`~agentloop.types.TokenDelta`).
        known: positions already known from earlier calls of the trajectory.
        end: positions past it are dropped (tokens a caller cut).

    Returns:
        None when the output has no routing (the key off, a dense engine) or nothing is left.
    """
    if getattr(output, "routed_experts", None) is None:
        return None
    rows, start = as_rows(output.routed_experts), int(output.routed_experts_start)
    skip = max(known - start, 0)
    rows = rows[skip:max(end - start, skip)]
    return (start + skip, rows) if len(rows) else None


def path_rows(pieces: Sequence[tuple[int, np.ndarray] | None]) -> np.ndarray | None:
    """The rows by position of a trajectory's calls, in order (each ``(start, rows)`` from
    :func:`call_rows`, None where a call had none); None when no call had routing."""
    joined: np.ndarray | None = None
    for piece in pieces:
        if piece is not None:
            joined = merge_rows(joined, piece[0], piece[1])
    return joined


def prompt_start(known: np.ndarray | None) -> dict[str, int]:
    """The sampling params that skip ``known`` rows (:data:`PROMPT_START_KEY`); ``{}`` when none
    are known."""
    return {PROMPT_START_KEY: len(known)} if known is not None and len(known) else {}


def routed_experts_rows(outputs: Sequence[AgentLoopOutput]) -> list[np.ndarray | None]:
    """Each output's ``routed_experts`` as rows (None where it has none)."""
    return [None if o.routed_experts is None else as_rows(o.routed_experts) for o in outputs]


def pad_routed_experts(
    outputs: Sequence[AgentLoopOutput], start: np.ndarray, kept_prompt: np.ndarray,
    total: np.ndarray, width: int, shape: tuple[int, int] | None = None,
) -> np.ndarray | None:
    """verl's ``routed_experts`` column: int16 [B, width, layers, top_k], row ``t`` the routing of
    ``input_ids[:, t]``, :data:`FILL` elsewhere.

    Args:
        outputs: the trajectories; ``routed_experts`` row ``i`` is token ``i`` of
            ``prompt_ids + response_ids``.
        start: per row, the column of its first kept prompt token (left padding).
        kept_prompt: per row, the prompt tokens kept (a longer prompt keeps its tail).
        total: per row, the kept prompt and response tokens.
        width: ``prompt_length + response_length``.
        shape: ``(layers, top_k)`` when routing replay is on (the column is built even if no row
            has routing); None: built only when some row has routing, shaped like it.

    Returns:
        The column, or None when there is nothing to build.

    Raises:
        DatasetError: rows disagree on ``(layers, top_k)``.
    """
    rows = routed_experts_rows(outputs)
    shapes = {r.shape[1:] for r in rows if r is not None}
    if shape is not None:
        shapes.add(tuple(shape))
    if not shapes:
        return None
    if len(shapes) > 1:
        raise DatasetError(
            f"routed_experts rows disagree on (layers, top_k): {sorted(shapes)}; "
            "every server must serve the same model"
        )
    out = np.full((len(outputs), width, *shapes.pop()), FILL, dtype=DTYPE)
    for b, r in enumerate(rows):
        if r is None:
            continue
        dropped = len(outputs[b].prompt_ids) - int(kept_prompt[b])  # a cut prompt loses its head
        kept = r[dropped:dropped + int(total[b])]
        out[b, int(start[b]):int(start[b]) + len(kept)] = kept
    return out


__all__ = [
    "DTYPE", "FILL", "PROMPT_START_KEY", "ROUTED_EXPERTS_KEY", "RoutedExpertsTrace", "as_rows",
    "call_rows", "join_routed_experts", "merge_rows", "pad_routed_experts", "path_rows",
    "prompt_start", "routed_experts_rows",
]
