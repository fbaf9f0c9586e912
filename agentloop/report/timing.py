"""Per-request timing of generate calls, recorded cheaply for ``agentloop report``'s server
timeline.

The router calls :func:`record_generate` after every engine call; it records only inside
:func:`collect_generate_calls`, which the worker opens around each sample (a context variable, so
tasks the loop spawns land in the same list; elsewhere recording is one context-variable read), and
:func:`attach_generate_calls` puts the list on the sample's first trajectory as
``extra_fields["generate_calls"]``.  One call is
``{"server", "start", "end", "prompt_tokens", "response_tokens", "stop_reason"}`` (epoch seconds),
plus ``"cached_tokens"`` (the prompt tokens the engine found in its prefix cache) where the engine
reports them (vLLM, SGLang).
Spec: docs/report.md#per-request-timing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import Any

from agentloop.types import CACHED_TOKENS_KEY

GENERATE_CALLS = "generate_calls"
"""The ``extra_fields`` key (and DataProto column) that holds a trajectory's generate calls."""

_calls: ContextVar[list[dict[str, Any]] | None] = ContextVar(
    "agentloop_generate_calls", default=None
)


def now() -> float:
    """The clock generate calls are timed with (epoch seconds)."""
    return time.time()


def record_generate(server: int, start: float, prompt_tokens: int, output: Any) -> None:
    """Record one finished engine call of the current sample (no-op outside
    :func:`collect_generate_calls`).

    ``output`` is the call's :class:`~agentloop.types.TokenOutput`; the end time is taken now.
    """
    calls = _calls.get()
    if calls is None:
        return
    stop = getattr(output, "stop_reason", None)
    call = {
        "server": int(server), "start": start, "end": time.time(),
        "prompt_tokens": int(prompt_tokens),
        "response_tokens": len(getattr(output, "token_ids", ()) or ()),
        "stop_reason": getattr(stop, "value", stop),
    }
    cached = (getattr(output, "extra_fields", None) or {}).get(CACHED_TOKENS_KEY)
    if cached is not None:  # the engine's prefix-cache hits, where it reports them
        call["cached_tokens"] = int(cached)
    calls.append(call)


@contextlib.contextmanager
def collect_generate_calls() -> Iterator[list[dict[str, Any]]]:
    """Collect the generate calls made inside this block (and tasks started in it) into the
    yielded list."""
    calls: list[dict[str, Any]] = []
    token = _calls.set(calls)
    try:
        yield calls
    finally:
        _calls.reset(token)


def attach_generate_calls(outputs: Any, calls: list[dict[str, Any]]) -> None:
    """Store ``calls`` on the first of a sample's trajectories (``extra_fields["generate_calls"]``)
    and an empty list on the others; a loop that set the key itself keeps its value. ``outputs``:
    the sample's trajectories, as a list of :class:`~agentloop.types.AgentLoopOutput` or an episode
    (an object with ``trajectories``)."""
    trajectories: Sequence[Any] = (
        outputs.trajectories if hasattr(outputs, "trajectories") else outputs
    )
    for i, output in enumerate(trajectories):
        output.extra_fields.setdefault(GENERATE_CALLS, list(calls) if i == 0 else [])
