"""Tracing: verl's rollout_trace_op / rollout_trace_attr on the jsonl recorder, and verl's
simple_timer."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

from agentloop import trace
from agentloop.compat.profiler import marked_timer, simple_timer
from agentloop.compat.rollout_trace import (
    RolloutTraceConfig,
    rollout_trace_attr,
    rollout_trace_op,
    select_traced_rows,
)
from agentloop.errors import ConfigError
from agentloop.types import AgentLoopOutput


@pytest.fixture(autouse=True)
def _tracing_off():
    RolloutTraceConfig.reset()
    yield
    RolloutTraceConfig.reset()


def _spans(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


class _Tokenizer:
    def decode(self, ids):
        return " ".join(f"t{i}" for i in ids)


class _Loop:
    tokenizer = _Tokenizer()

    def __init__(self):
        self.calls = 0

    @rollout_trace_op
    async def run(self, sampling_params, *, raw_prompt, extra=None):
        self.calls += 1
        return AgentLoopOutput(prompt_ids=[1, 2], response_ids=[3], response_mask=[1])

    @rollout_trace_op
    async def fail(self, x):
        raise ValueError(f"bad {x}")

    @rollout_trace_op
    def score(self, text, weight=2):
        return len(text) * weight


def _jsonl(tmp_path, **kwargs):
    path = tmp_path / "spans.jsonl"
    RolloutTraceConfig.init("proj", "exp1", "jsonl", path=str(path), **kwargs)
    return path


def test_trace_op_records_inputs_and_outputs(tmp_path):
    path = _jsonl(tmp_path)
    loop = _Loop()
    out = asyncio.run(
        loop.run({"temperature": 1.0}, raw_prompt=[{"role": "user", "content": "hi"}])
    )
    assert out.response_ids == [3] and trace.enabled()
    (span,) = _spans(path)
    assert span["name"] == "_Loop.run"
    assert span["inputs"] == {
        "sampling_params": {"temperature": 1.0}, "raw_prompt": [{"role": "user", "content": "hi"}],
        "extra": None,
    }
    assert span["outputs"]["prompt_ids"] == [1, 2] and span["outputs"]["status"] == "stop"
    assert span["end"] >= span["start"] and span["error"] is None and span["parent_id"] is None


def test_disabled_records_nothing_and_still_runs(tmp_path):
    loop = _Loop()
    assert not trace.enabled()
    asyncio.run(loop.run({}, raw_prompt=[]))
    assert loop.score("ab") == 4 and loop.calls == 1
    with rollout_trace_attr(step=1, sample_index=0, rollout_n=0):
        asyncio.run(loop.run({}, raw_prompt=[]))
    assert list(tmp_path.iterdir()) == []
    RolloutTraceConfig.init("proj", "exp", None)
    assert RolloutTraceConfig.get_backend() is None and not trace.enabled()


def test_trace_attr_attaches_attributes_and_parent(tmp_path):
    path = _jsonl(tmp_path)
    loop = _Loop()

    async def one(i):
        with rollout_trace_attr(
            step=3, sample_index=i, rollout_n=i % 2, validate=True, name="agent_loop"
        ):
            await asyncio.sleep(0)
            await loop.run({}, raw_prompt=[])

    async def batch():
        await asyncio.gather(*(one(i) for i in range(3)))

    asyncio.run(batch())
    spans = _spans(path)
    runs = [s for s in spans if s["name"] == "_Loop.run"]
    parents = {s["span_id"]: s for s in spans if s["name"] == "agent_loop"}
    assert len(runs) == 3 and len(parents) == 3
    for span in runs:
        attrs = span["attrs"]
        assert (
            attrs["step"] == 3 and attrs["validate"] is True and attrs["experiment_name"] == "exp1"
        )
        assert attrs["rollout_n"] == attrs["sample_index"] % 2
        assert parents[span["parent_id"]]["attrs"]["sample_index"] == attrs["sample_index"]


def test_trace_attr_trace_false_suppresses(tmp_path):
    path = _jsonl(tmp_path)
    loop = _Loop()
    with rollout_trace_attr(step=1, sample_index=0, rollout_n=0, trace=False):
        asyncio.run(loop.run({}, raw_prompt=[]))
        assert not trace.enabled()
    assert trace.enabled()
    assert not path.exists() or path.read_text() == ""


def test_exception_is_recorded_and_reraised(tmp_path):
    path = _jsonl(tmp_path)
    with pytest.raises(ValueError, match="bad 7"):
        asyncio.run(_Loop().fail(7))
    (span,) = _spans(path)
    assert (
        span["inputs"] == {"x": 7}
        and span["error"] == "ValueError: bad 7"
        and span["outputs"] is None
    )


def test_sync_method_and_token2text(tmp_path):
    path = _jsonl(tmp_path, token2text=True)
    loop = _Loop()
    assert loop.score("abc", weight=3) == 9
    asyncio.run(loop.run({}, raw_prompt=[]))
    score, run = _spans(path)
    assert score["inputs"] == {"text": "abc", "weight": 3} and score["outputs"] == 9
    assert run["outputs"]["prompt_text"] == "t1 t2" and run["outputs"]["response_text"] == "t3"


def test_jsonl_values_are_json_safe_and_truncated(tmp_path):
    path = tmp_path / "t.jsonl"
    trace.configure("jsonl", path, max_list_items=4, max_str_chars=5)
    inputs = {
        "ids": list(range(10)), "arr": np.arange(6), "obj": object(), 3: float("nan"),
        "s": "abcdefgh",
    }
    trace.record_span(
        "long_span_name", inputs=inputs, outputs=(1, 2), start=1.0, end=2.5, attrs={"k": {1, 2}}
    )
    (span,) = _spans(path)
    assert span["inputs"]["ids"] == [0, 1, 2, 3, "... (+6 more)"]
    assert span["inputs"]["arr"] == [0, 1, 2, 3, "... (+2 more)"]
    assert span["inputs"]["obj"].startswith("<obje... (+") and span["inputs"]["3"] == "nan"
    assert span["inputs"]["s"] == "abcde... (+3 more)"
    assert span["name"] == "long_span_name"  # limits apply to the payload only
    assert (
        span["outputs"] == [1, 2] and span["duration_s"] == 1.5 and span["attrs"] == {"k": [1, 2]}
    )


def test_trace_attributes_nest_and_reach_child_tasks(tmp_path):
    path = tmp_path / "t.jsonl"
    trace.configure("jsonl", path)

    async def child():
        trace.record_span("child", start=0.0, end=0.0)

    async def main():
        with trace.trace_attributes(step=1, a="outer"), trace.trace_attributes(a="inner"):
            await asyncio.create_task(child())
        trace.record_span("after", start=0.0, end=0.0)

    asyncio.run(main())
    child_span, after = _spans(path)
    assert child_span["attrs"] == {"step": 1, "a": "inner"} and after["attrs"] == {}


def test_unsupported_backends_say_which_are_supported():
    for backend in ("weave", "trackio", "otel"):
        with pytest.raises(ConfigError, match="supported: null \\(off\\), 'jsonl' and 'mlflow'"):
            RolloutTraceConfig.init("p", "e", backend)
    with pytest.raises(ConfigError, match="supported backends"):
        trace.configure("otel")
    with pytest.raises(ConfigError, match="needs a file"):
        trace.configure("jsonl")


def test_init_is_once_per_process_and_singleton(tmp_path):
    _jsonl(tmp_path, max_samples_per_step_per_worker=2)
    RolloutTraceConfig.init("other", "exp2", None)  # ignored, as in verl
    config = RolloutTraceConfig.get_instance()
    assert (
        config is RolloutTraceConfig()
        and config.backend == "jsonl"
        and config.experiment_name == "exp1"
    )
    assert config.max_samples_per_step_per_worker == 2 and RolloutTraceConfig.get_client() is None


def test_select_traced_rows_keeps_all_rollouts_of_chosen_samples():
    index = [0, 0, 1, 1, 2, 2]
    assert select_traced_rows(index, None) == set(range(6))
    assert select_traced_rows(index, 5) == set(range(6))
    rows = select_traced_rows(index, 2, seed=0)
    assert len(rows) == 4 and {index[i] for i in rows} == {index[i] for i in rows if i % 2 == 0}


def test_simple_timer_accumulates_seconds():
    timing: dict[str, float] = {}
    with simple_timer("gen", timing):
        time.sleep(0.02)
    first = timing["gen"]
    with simple_timer("gen", timing):
        time.sleep(0.02)
    with marked_timer("tool", timing, color="red"):
        pass
    assert 0.015 < first < 1.0 and timing["gen"] > first + 0.015 and set(timing) == {"gen", "tool"}
    with pytest.raises(RuntimeError), simple_timer("boom", timing):
        raise RuntimeError("x")
    assert "boom" not in timing  # verl adds nothing when the block raises
