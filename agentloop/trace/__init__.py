"""Rollout tracing: one recorder API, with ``none``, ``jsonl`` and ``mlflow`` backends
(docs/tracing.md).

    from agentloop import trace

    trace.configure("jsonl", path="/tmp/spans.jsonl")
    with trace.trace_attributes(step=3, sample_index=7, rollout_n=0, validate=False):
        with trace.span("my_tool", inputs={"x": 1}) as s:
            s.outputs = {"y": 2}

verl's decorator and context manager (``rollout_trace_op``, ``rollout_trace_attr``,
``RolloutTraceConfig``) are in :mod:`agentloop.compat.rollout_trace`, built on this API.
"""

from agentloop.trace.jsonl import JsonlBackend, to_jsonable
from agentloop.trace.recorder import (
    BACKENDS,
    TraceBackend,
    backend,
    configure,
    current_attributes,
    decode_tokens,
    enabled,
    flush,
    new_span_id,
    record_span,
    set_token_decoder,
    span,
    suppressed,
    trace_attributes,
)

__all__ = [
    "BACKENDS", "JsonlBackend", "TraceBackend", "backend", "configure", "current_attributes",
    "decode_tokens", "enabled", "flush", "new_span_id", "record_span", "set_token_decoder", "span",
    "suppressed", "to_jsonable", "trace_attributes",
]
