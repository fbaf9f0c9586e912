"""The trace recorder: one process-wide backend, spans, and attributes carried by context.

Spec:

* :func:`configure` picks the backend (``"none"``, ``"jsonl"`` or ``"mlflow"``) for this process; a
  second call closes the previous backend first.  Ray workers are separate processes: each
  configures its own recorder.
* :func:`enabled` is one module-global bool check while tracing is off; when on, it is also False
  inside :func:`suppressed` (verl's ``rollout_trace_attr(trace=False)``).
* :func:`record_span` writes one span: ``name``, ``inputs``, ``outputs``, ``start``/``end`` (epoch
  seconds), ``attrs`` (the context's attributes updated by the explicit ones), ``span_id``,
  ``parent_id`` (the innermost open :func:`span`), ``pid`` and ``error``.  It does nothing while
  tracing is off.
* :func:`trace_attributes` attaches attributes (``step``, ``sample_index``, ``rollout_n``,
  ``validate``, ...) to every span recorded inside it, also in tasks created inside it
  (contextvars); nesting merges.
* :func:`span` times a block and records it on exit, with the exception as ``error`` if one escaped.
"""

from __future__ import annotations

import itertools
import os
import time
from contextvars import ContextVar, Token
from types import TracebackType
from typing import Any, Protocol

from agentloop.errors import ConfigError
from agentloop.trace.jsonl import DEFAULT_MAX_LIST_ITEMS, DEFAULT_MAX_STR_CHARS, JsonlBackend

BACKENDS = ("none", "jsonl", "mlflow")


class TraceBackend(Protocol):
    """Where spans go: ``write`` gets one plain-dict record per span."""

    name: str

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


_on: bool = False
_backend: TraceBackend | None = None
_attributes: ContextVar[dict[str, Any] | None] = ContextVar(
    "agentloop_trace_attributes", default=None
)
_suppressed: ContextVar[bool] = ContextVar("agentloop_trace_suppressed", default=False)
_current_span: ContextVar[str | None] = ContextVar("agentloop_trace_span", default=None)
_ids = itertools.count(1)
_decoder: Any = None


def set_token_decoder(decode: Any) -> None:
    """``decode(ids) -> str`` used by :func:`decode_tokens` (verl's ``token2text``); None turns
    text off."""
    global _decoder
    _decoder = decode


def decode_tokens(ids: Any) -> str | None:
    """The text of ``ids`` when a token decoder is set (``rollout.trace.token2text``), else None."""
    decode = _decoder
    if decode is None:
        return None
    try:
        return str(decode(list(ids)))
    except Exception:  # noqa: BLE001 - a trace never fails the rollout
        return None


def configure(
    backend: str | None = "none", path: str | os.PathLike[str] | None = None, *,
    max_list_items: int = DEFAULT_MAX_LIST_ITEMS, max_str_chars: int = DEFAULT_MAX_STR_CHARS,
    experiment: str = "agentloop",
) -> None:
    """Turn tracing on (``"jsonl"``, which needs ``path``; ``"mlflow"``) or off (``"none"`` or None)
    here.

    Args:
        backend: ``"none"`` / None, ``"jsonl"`` or ``"mlflow"``
        (:mod:`agentloop.trace.mlflow_backend`). path: the JSONL file spans are appended to
        (``{pid}`` is replaced by the process id); for mlflow the
            tracking URI (default ``MLFLOW_TRACKING_URI``, else
            ``sqlite:///./rollout_traces/mlflow.db``).
        max_list_items: lists longer than this are truncated in records.
        max_str_chars: strings longer than this are truncated in records.
        experiment: the MLflow experiment the traces go to.
    """
    global _on, _backend
    name = "none" if backend is None else str(backend).lower()
    if name not in BACKENDS:
        raise ConfigError(
            f"unknown trace backend {backend!r}; supported backends: {list(BACKENDS)}"
        )
    new: TraceBackend | None = None
    # path: the tracking URI (default: MLFLOW_TRACKING_URI, else a local SQLite file)
    if name == "mlflow":
        # mlflow is an optional dependency: imported only when chosen
        from agentloop.trace.mlflow_backend import MlflowBackend

        new = MlflowBackend(None if path is None else str(path), experiment=experiment)
    if name == "jsonl":
        if path is None:
            raise ConfigError(
                "trace backend 'jsonl' needs a file: "
                "configure(backend='jsonl', path='traces.jsonl')"
            )
        new = JsonlBackend(path, max_list_items=max_list_items, max_str_chars=max_str_chars)
    old, _backend, _on = _backend, new, new is not None
    if old is not None:
        old.close()


def flush() -> None:
    """Wait until the backend has written what it was given (the mlflow backend writes from a
    thread)."""
    sink = _backend
    if sink is not None and hasattr(sink, "flush"):
        sink.flush()


def backend() -> TraceBackend | None:
    """The configured backend, or None while tracing is off."""
    return _backend


def enabled() -> bool:
    """True while a backend is configured and the current context does not suppress tracing."""
    return _on and not _suppressed.get()


def current_attributes() -> dict[str, Any]:
    """A copy of the attributes the current context attaches to spans."""
    return dict(_attributes.get() or {})


def new_span_id() -> str:
    """A span id unique across the processes writing one trace (``<pid hex>-<counter>``)."""
    return f"{os.getpid():x}-{next(_ids)}"


def record_span(
    name: str, *, inputs: Any = None, outputs: Any = None, start: float, end: float,
    attrs: dict[str, Any] | None = None, error: str | None = None, span_id: str | None = None,
    parent_id: str | None = None,
) -> None:
    """Write one span to the backend (nothing while tracing is off; see the module docstring)."""
    sink = _backend
    if not _on or sink is None or _suppressed.get():
        return
    merged = current_attributes()
    if attrs:
        merged.update(attrs)
    sink.write(
        {
            "name": name, "span_id": span_id or new_span_id(),
            "parent_id": parent_id if parent_id is not None else _current_span.get(),
            "start": start, "end": end, "duration_s": end - start, "attrs": merged,
            "inputs": inputs, "outputs": outputs, "error": error, "pid": os.getpid(),
        }
    )


class trace_attributes:  # lower-case: used like a function, ``with trace_attributes(step=3):``
    """Attach ``attrs`` to every span recorded inside the ``with`` block (merged over outer ones).

    Costs one bool check while tracing is off.
    """

    __slots__ = ("_attrs", "_token")

    def __init__(self, **attrs: Any) -> None:
        self._attrs = attrs
        self._token: Token[dict[str, Any] | None] | None = None

    def __enter__(self) -> None:
        if _on:
            self._token = _attributes.set({**(_attributes.get() or {}), **self._attrs})

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _attributes.reset(self._token)
            self._token = None


class suppressed:  # lower-case: used like a function, ``with suppressed():``
    """Record nothing inside the ``with`` block (verl's ``rollout_trace_attr(trace=False)``)."""

    __slots__ = ("_token",)

    def __init__(self) -> None:
        self._token: Token[bool] | None = None

    def __enter__(self) -> None:
        if _on:
            self._token = _suppressed.set(True)

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _suppressed.reset(self._token)
            self._token = None


class span:  # lower-case: used like a function, ``with span("tool", inputs=...) as s:``
    """Time a block and record it as a span on exit; spans opened inside it name it as their parent.

    Set ``outputs`` on the object the ``with`` yields.  An exception escaping the block is recorded
    as ``error`` and re-raised.  While tracing is off the block runs with no bookkeeping.
    """

    __slots__ = (
        "name", "inputs", "outputs", "attrs", "error", "span_id", "parent_id", "start", "_token",
    )

    def __init__(
        self, name: str, *, inputs: Any = None, attrs: dict[str, Any] | None = None
    ) -> None:
        self.name = name
        self.inputs = inputs
        self.outputs: Any = None
        self.attrs = attrs
        self.error: str | None = None
        self.span_id: str | None = None
        self.parent_id: str | None = None
        self.start = 0.0
        self._token: Token[str | None] | None = None

    def __enter__(self) -> span:
        if enabled():
            self.span_id = new_span_id()
            self.parent_id = _current_span.get()
            self._token = _current_span.set(self.span_id)
            self.start = time.time()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._token is None:
            return
        end = time.time()
        _current_span.reset(self._token)
        self._token = None
        if exc is not None and self.error is None:
            self.error = f"{type(exc).__name__}: {exc}"
        record_span(
            self.name, inputs=self.inputs, outputs=self.outputs, start=self.start, end=end,
            attrs=self.attrs, error=self.error, span_id=self.span_id, parent_id=self.parent_id,
        )
