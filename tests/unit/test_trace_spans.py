"""Rollout traces of a tool_agent sample (fake engine, tiny tokenizer): one span per generate call,
per tool call and per interaction turn, all carrying the sample's attributes; ``token2text`` adds
the decoded text."""

from __future__ import annotations

import asyncio
import json

import pytest
from omegaconf import OmegaConf

from agentloop import trace
from agentloop.compat.rollout_trace import rollout_trace_attr
from agentloop.config import default_config
from agentloop.loops.tool_agent import ToolAgentLoop
from agentloop.routing import AsyncLLMServerManager
from agentloop.testing import ScriptedServer


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from agentloop.testing.tiny_model import ensure_tiny_model

    return AutoTokenizer.from_pretrained(str(ensure_tiny_model()))


def call(tok, expression: str) -> list[int]:
    body = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    text = f"<tool_call>\n{body}\n</tool_call>"
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


def run_sample(tok, tmp_path, backend: str, target: str):
    inter = tmp_path / "interactions.yaml"
    inter.write_text("interaction:\n  - name: grader\n"
                     "    class_name: agentloop.interactions.answer_check.AnswerCheckInteraction\n")
    cfg = default_config()
    OmegaConf.resolve(cfg)
    rollout = cfg.actor_rollout_ref.rollout
    rollout.multi_turn.tool_config_path = "examples/calculator_agent/tools.yaml"
    rollout.multi_turn.interaction_config_path = str(inter)
    answer = tok.encode("The answer is 5.", add_special_tokens=False) + [tok.eos_token_id]
    script = [call(tok, "2 + 3"), call(tok, "2 / 0"), answer]
    server = ScriptedServer(script, eos_token_id=tok.eos_token_id)
    trace.configure(backend, target, experiment="agentloop-test")
    trace.set_token_decoder(lambda ids: tok.decode(ids, skip_special_tokens=False))
    try:
        async def go():
            ToolAgentLoop.init_class(rollout, tok)
            loop = ToolAgentLoop(rollout, AsyncLLMServerManager([server]), tok)
            with rollout_trace_attr(
                step=3, sample_index=7, rollout_n=0, validate=False, name="agent_loop"
            ):
                return await loop.run(
                    {}, raw_prompt=[{"role": "user", "content": "What is 2 + 3?"}],
                    extra_info={"interaction_kwargs": {"name": "grader", "ground_truth": "5"}},
                )

        asyncio.run(go())
    finally:
        trace.configure("none")  # closes the backend: everything is written
        trace.set_token_decoder(None)
    return script, server


def test_a_tool_agent_sample_gives_generate_tool_and_interaction_spans(tok, tmp_path):
    path = tmp_path / "spans.jsonl"
    script, server = run_sample(tok, tmp_path, "jsonl", str(path))
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    by_name: dict[str, list[dict]] = {}
    for s in spans:
        by_name.setdefault(s["name"], []).append(s)
    assert len(by_name["generate"]) == 3 == len(server.calls)  # one span per engine call
    assert (
        len(by_name["tool"]) == 2
        and len(by_name["interaction"]) == 1
        and len(by_name["agent_loop"]) == 1
    )
    first = by_name["generate"][0]
    assert first["inputs"]["prompt_tokens"] == len(server.calls[0]["prompt_ids"])
    assert first["outputs"]["response_tokens"] == len(script[0])
    # token2text
    assert first["outputs"]["response_text"] == tok.decode(script[0], skip_special_tokens=False)
    ok, failed = by_name["tool"]
    assert (
        json.loads(ok["inputs"]["arguments"]) == {"expression": "2 + 3"}
        and ok["outputs"]["result"] == "5"
    )
    # the tool answered with an error
    assert ok["error"] is None and "zero" in failed["outputs"]["result"].lower()
    assert by_name["interaction"][0]["outputs"]["score"] == 1.0
    root = by_name["agent_loop"][0]["span_id"]
    for s in spans:  # every span belongs to the sample's trace
        assert (s["attrs"]["step"], s["attrs"]["sample_index"]) == (3, 7)
        assert s["end"] >= s["start"] and (s["parent_id"] == root or s["span_id"] == root)


def test_the_mlflow_backend_writes_one_trace_per_sample_readable_by_search_traces(tok, tmp_path):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    script, _ = run_sample(tok, tmp_path, "mlflow", uri)
    mlflow.set_tracking_uri(uri)
    experiment = mlflow.get_experiment_by_name("agentloop-test")
    traces = mlflow.search_traces(experiment_ids=[experiment.experiment_id], return_type="list")
    assert len(traces) == 1
    names = sorted(span.name for span in traces[0].data.spans)
    assert names == [
        "agent_loop", "generate", "generate", "generate", "interaction", "tool", "tool",
    ]
    generate = [span for span in traces[0].data.spans if span.name == "generate"]
    assert generate[0].outputs["response_text"] == tok.decode(script[0], skip_special_tokens=False)
