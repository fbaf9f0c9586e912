"""Exit codes of the ``agentloop`` CLI and the verdict on a finished rollout's failed rows.

0: finished, at most ``rollout.agent.max_failure_fraction`` of the rows failed; 1: an unexpected
exception (traceback printed); 2: bad input, any :class:`agentloop.errors.AgentLoopError`, printed
as one line ``agentloop: error: <message>``; 3: the outputs were written but more than
``max_failure_fraction`` of the rows ended ``error`` or ``timeout`` (the most common messages
printed).  Only ``error`` / ``timeout`` rows count as failed: ``tool_error``, ``parse_error`` and
the like are the policy's behaviour (training data). Spec: docs/config.md#exit-codes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

EXIT_OK = 0
EXIT_CRASH = 1
EXIT_BAD_INPUT = 2
EXIT_TOO_MANY_FAILURES = 3

FAILED_STATUSES = ("error", "timeout")
"""Row statuses that count as failed samples."""

FAILURE_KEY = "actor_rollout_ref.rollout.agent.max_failure_fraction"

_MAX_MESSAGE_CHARS = 300


@dataclass(frozen=True)
class FailureVerdict:
    """What the CLI does about a finished rollout's failed rows."""

    exit_code: int
    """:data:`EXIT_OK` or :data:`EXIT_TOO_MANY_FAILURES`."""
    num_failed: int
    num_rows: int
    message: str | None
    """For a failed run: a report naming the counts, the threshold and the top error messages."""


def _label(status: str, error: object) -> str:
    text = " ".join(str(error).split()) if error not in (None, "") else "(no error message)"
    if len(text) > _MAX_MESSAGE_CHARS:
        text = text[: _MAX_MESSAGE_CHARS - 3] + "..."
    return f"[{status}] {text}"


def failure_verdict(
    statuses: Iterable[object], errors: Iterable[object], max_failure_fraction: float | None, *,
    top: int = 3,
) -> FailureVerdict:
    """Decide the exit code from the output rows' ``status`` and ``error`` columns.

    The run fails (:data:`EXIT_TOO_MANY_FAILURES`) when the fraction of rows whose status is in
    :data:`FAILED_STATUSES` is strictly greater than ``max_failure_fraction``; ``None`` never fails.
    The message lists the ``top`` most common error messages (whitespace collapsed) with their
    counts.
    """
    status_list = [str(s) for s in statuses]
    error_list = list(errors)
    if len(error_list) != len(status_list):
        raise ValueError(
            f"failure_verdict: {len(status_list)} statuses but {len(error_list)} errors"
        )
    failed = [(s, e) for s, e in zip(status_list, error_list, strict=True) if s in FAILED_STATUSES]
    rows = len(status_list)
    if max_failure_fraction is None or rows == 0 or len(failed) / rows <= max_failure_fraction:
        return FailureVerdict(EXIT_OK, len(failed), rows, None)
    by_status = Counter(s for s, _ in failed)
    common = Counter(_label(s, e) for s, e in failed).most_common(top)
    lines = [
        f"{len(failed)} of {rows} rows failed ("
        + ", ".join(f"{s}: {n}" for s, n in sorted(by_status.items()))
        + f"), more than {FAILURE_KEY}={max_failure_fraction}. Most common errors:",
        *(f"  {n} x {label}" for label, n in common),
        f"The outputs were written all the same. Fix the cause above, or set {FAILURE_KEY} higher "
        "(null: never fail on failed rows).",
    ]
    return FailureVerdict(EXIT_TOO_MANY_FAILURES, len(failed), rows, "\n".join(lines))
