"""``agentloop report`` and ``agentloop verify`` on output directories built here (no engine, no
Ray).

The report runs on a synthetic rollout padded by the real ``postprocess`` and saved as the CLI saves
it; verify runs the tiny HF model on trajectories whose log-probs are computed here independently
(one unbatched forward per row), and the template check on a conversation tokenized here by hand.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from agentloop.batch.postprocess import postprocess
from agentloop.cli.rollout import main
from agentloop.report.plots import PLOTS, lanes, timeline_stats
from agentloop.report.timing import GENERATE_CALLS, attach_generate_calls, collect_generate_calls
from agentloop.types import AgentLoopOutput, RolloutStatus

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


def synthetic_outputs(
    *, tools: bool = True, rewards: bool = True, calls: bool = True
) -> list[AgentLoopOutput]:
    """12 trajectories: 0-2 tool calls, turns 2 + 2 * calls, reward 1.0 on even rows, two
    servers, one straggler."""
    outputs = []
    for i in range(12):
        n_tools = i % 3
        response = list(range(10, 16 + 3 * i))
        mask = [1] * len(response)
        for t in range(n_tools):
            mask[2 + 2 * t] = 0
        extra: dict[str, Any] = {}
        if tools:
            extra["num_tool_calls"] = n_tools
        if calls:
            end = 11.0 if i == 5 else 1.0 + 0.2 * i  # row 5 is the long tail
            extra[GENERATE_CALLS] = [
                {
                    "server": i % 2, "start": 0.1 * i, "end": end, "prompt_tokens": 3,
                    "response_tokens": len(response), "stop_reason": "stop",
                }
            ]
        outputs.append(
            AgentLoopOutput(
                prompt_ids=[1, 2, 3], response_ids=response, response_mask=mask,
                response_logprobs=[-0.5] * len(response), num_turns=2 + 2 * n_tools,
                reward_score=float(i % 2 == 0) if rewards else None,
                status=RolloutStatus.LENGTH if i == 11 else RolloutStatus.STOP, extra_fields=extra,
            )
        )
    return outputs


def save_rollout(directory: Path, outputs: list[AgentLoopOutput], log_probs: bool = True) -> Path:
    """Pad ``outputs`` and save them the way ``agentloop rollout`` does (rollout.dataproto +
    summary.json)."""
    data = postprocess(
        outputs, prompt_length=8, response_length=64, pad_token_id=0, calculate_log_probs=log_probs
    )
    directory.mkdir(parents=True, exist_ok=True)
    data.save_to_disk(str(directory / "rollout.dataproto"))
    (directory / "summary.json").write_text(
        json.dumps({"num_samples": len(outputs), "wall_time_s": 2.5})
    )
    return directory


def test_report_writes_every_plot_and_a_page_that_shows_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = save_rollout(tmp_path / "run", synthetic_outputs())
    code, stdout, _ = run_cli(["report", str(out)], capsys)
    assert code == 0 and "report.html" in stdout
    page = (out / "report.html").read_text()
    for name, title, _ in PLOTS:
        png = out / "report" / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 2000, name
        assert f'src="report/{name}.png"' in page and title in page
    assert "mean reward</th><td>0.5</td>" in page  # rewards 1.0 on the 6 even rows of 12
    assert "tool-call rate (trajectories with a tool call)</th><td>0.667</td>" in page
    assert "length: 1" in page and "stop: 11" in page
    # the straggler ends at 11.0 s, the others by 3.2 s (90th percentile of the 12 end times: 3.18
    # s)
    assert (
        "tail_s</th><td>7.82</td>" in page
        and "calls_per_server</th><td>server 0: 6, server 1: 6" in page
    )


def test_report_says_what_is_missing_and_can_embed_the_images(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = save_rollout(
        tmp_path / "bare", synthetic_outputs(tools=False, rewards=False, calls=False)
    )
    code, _, _ = run_cli(["report", str(out), "--embed"], capsys)
    page = (out / "report.html").read_text()
    assert code == 0
    assert (
        "custom_reward_function.path" in page
        and "num_tool_calls" in page
        and "generate_calls" in page
    )
    assert page.count("data:image/png;base64,") == len(PLOTS) and 'src="report/' not in page


def test_report_groups_rows_by_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rows with an ``env`` (env_agent / self-play) get one line per environment: count, mean
    reward over the valid rewards, statuses, mean turns; rows without one are grouped apart."""
    outputs = synthetic_outputs()
    envs = ["skyrl_gym", "textarena", None]
    for i, out in enumerate(outputs):
        if envs[i % 3] is not None:
            out.extra_fields["env"] = envs[i % 3]
    out_dir = save_rollout(tmp_path / "envs", outputs)
    code, _, _ = run_cli(["report", str(out_dir)], capsys)
    page = (out_dir / "report.html").read_text()
    assert code == 0 and "<h2>By environment</h2>" in page
    # skyrl_gym rows 0, 3, 6, 9: rewards 1, 0, 1, 0; turns 2 + 2 * (i % 3) = 2 each
    assert ("<tr><th>skyrl_gym</th><td>4</td><td>0.5</td><td>stop: 4</td><td>2.0</td></tr>"
            in page)
    # textarena rows 1, 4, 7, 10: rewards 0, 1, 0, 1; turns 4
    assert ("<tr><th>textarena</th><td>4</td><td>0.5</td><td>stop: 4</td><td>4.0</td></tr>"
            in page)
    # rows 2, 5, 8, 11 (11 ended length): rewards 1, 0, 1, 0; turns 6
    assert ("<tr><th>(no env)</th><td>4</td><td>0.5</td><td>stop: 3, length: 1</td>"
            "<td>6.0</td></tr>" in page)
    plain = save_rollout(tmp_path / "plain", synthetic_outputs())
    run_cli(["report", str(plain)], capsys)
    assert "By environment" not in (plain / "report.html").read_text()


@pytest.mark.parametrize("layout", ["no_dir", "empty_dir", "not_a_dataproto", "not_a_rollout"])
def test_report_bad_input_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: str
) -> None:
    target = tmp_path / "out"
    if layout != "no_dir":
        target.mkdir()
    if layout == "not_a_dataproto":
        (target / "rollout.dataproto").write_text("hello")
    if layout == "not_a_rollout":
        from agentloop.batch.protocol import DataProto

        DataProto.from_dict({"x": torch.zeros(2, 3)}).save_to_disk(
            str(target / "rollout.dataproto")
        )
    code, _, err = run_cli(["report", str(target)], capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("agentloop: error: ")
    assert "agentloop rollout" in err  # how to produce the missing outputs


def test_lanes_never_overlap_and_reuse_free_lanes() -> None:
    spans = [(0.0, 5.0), (1.0, 2.0), (2.0, 3.0), (1.5, 4.0), (6.0, 7.0)]
    got = lanes(spans)
    for i, a in enumerate(spans):
        for j, b in enumerate(spans[:i]):
            if got[i] == got[j]:
                assert a[0] >= b[1] or b[0] >= a[1], (a, b)
    assert max(got) == 2  # at most 3 calls overlap at once (t=1.5..2.0)
    assert got[4] == 0  # after t=5 every lane is free again


def test_timeline_stats_measure_the_tail() -> None:
    calls = [{"server": s, "start": 0.0, "end": e} for s, e in [(0, 1.0)] * 9 + [(1, 10.0)]]
    stats = timeline_stats(calls)
    assert stats["calls_per_server"] == {"server 0": 9, "server 1": 1}
    assert stats["span_s"] == 10.0 and stats["call_s_max"] == 10.0
    assert 8.0 < stats["tail_s"] < 9.0 and stats["tail_fraction"] > 0.8


def test_router_records_each_generate_call_only_inside_a_collection() -> None:
    from agentloop.routing import AsyncLLMServerManager
    from agentloop.testing import ScriptedServer

    router = AsyncLLMServerManager([ScriptedServer(delay=0.01), ScriptedServer(delay=0.01)])

    async def sample(name: str) -> list[dict[str, Any]]:
        with collect_generate_calls() as calls:
            await router.generate(name, prompt_ids=[1, 2, 3], sampling_params={"max_tokens": 2})
            await asyncio.gather(
                *(
                    router.generate(
                        f"{name}-{k}", prompt_ids=[1, 2, 3, 4, 5], sampling_params={"max_tokens": 2}
                    )
                    for k in range(2)
                )
            )
        return calls

    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        await router.generate("outside", prompt_ids=[1], sampling_params={})
        a, b = await asyncio.gather(sample("a"), sample("b"))
        return a, b

    a, b = asyncio.run(run())
    # each sample sees its own calls, spawned tasks included, none from outside
    assert len(a) == len(b) == 3
    assert sorted(c["prompt_tokens"] for c in a) == [3, 5, 5]
    assert all(
        c["response_tokens"] == 2 and c["end"] >= c["start"] + 0.005 and c["server"] in (0, 1)
        for c in a
    )
    outputs = [
        AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1]) for _ in range(2)
    ]
    attach_generate_calls(outputs, a)
    assert (
        outputs[0].extra_fields[GENERATE_CALLS] == a
        and outputs[1].extra_fields[GENERATE_CALLS] == []
    )
    episode = SimpleNamespace(
        trajectories=[
            AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1])
            # a MultiTrajectoryAgentLoopOutput's shape
            for _ in range(2)
        ]
    )
    attach_generate_calls(episode, b)
    assert [t.extra_fields[GENERATE_CALLS] for t in episode.trajectories] == [b, []]


# ---- verify
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_path() -> str:
    from agentloop.testing.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model())


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def hf_log_probs(
    model_path: str, prompt: list[int], response: list[int], temperature: float
) -> list[float]:
    """log_softmax(logits / T) of each response token, from one unbatched forward pass."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
    return (
        torch.log_softmax(logits / temperature, -1)
        .gather(-1, torch.tensor(response)[:, None])[:, 0]
        .tolist()
    )


def encode(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def calculator_trajectory(
    tokenizer: Any, model_path: str, tool_result: str = "5"
) -> AgentLoopOutput:
    """A two-turn calculator conversation tokenized by hand: sampled turns mask 1, the tool turn
    mask 0."""
    prompt_messages = [{"role": "user", "content": "Calculate 2 + 3."}]
    prompt = encode(tokenizer, tokenizer.apply_chat_template(prompt_messages, tokenize=False,
                                                             add_generation_prompt=True))
    call = encode(
        tokenizer,
        '<tool_call>\n{"name": "calculator", "arguments": '
        '{"expression": "2 + 3"}}\n'
        "</tool_call><|im_end|>",
    )
    tool = encode(
        tokenizer,
        f"\n<|im_start|>user\n<tool_response>\n{tool_result}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n",
    )
    answer = encode(tokenizer, "The answer is 5.<|im_end|>")
    response = call + tool + answer
    log_probs = hf_log_probs(model_path, prompt, response, temperature=0.7)
    mask = [1] * len(call) + [0] * len(tool) + [1] * len(answer)
    messages = [
        *prompt_messages,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "2 + 3"}'},
                }
            ],
        },
        {"role": "tool", "content": "5", "name": "calculator"},
        {"role": "assistant", "content": "The answer is 5."},
    ]
    return AgentLoopOutput(
        prompt_ids=prompt, response_ids=response, response_mask=mask,
        response_logprobs=[lp if m else 0.0 for lp, m in zip(log_probs, mask, strict=True)],
        num_turns=4, extra_fields={"messages": messages},
    )


def save_verifiable(
    directory: Path, outputs: list[AgentLoopOutput], prompts: list[list[dict[str, Any]]]
) -> Path:
    raw_prompt = np.empty(len(prompts), dtype=object)
    for i, messages in enumerate(prompts):
        raw_prompt[i] = messages
    data = postprocess(
        outputs, prompt_length=64, response_length=96, pad_token_id=0, calculate_log_probs=True,
        sample_fields={"raw_prompt": raw_prompt},
    )
    directory.mkdir(parents=True, exist_ok=True)
    data.save_to_disk(str(directory / "rollout.dataproto"))
    return directory


@pytest.fixture(scope="module")
def verifiable(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any, model_path: str) -> Path:
    """Two rows of different lengths (so padding and batching are exercised) with exact log-probs
    at T=0.7."""
    prompt = [{"role": "user", "content": "Calculate 2 + 3."}]
    short = calculator_trajectory(tokenizer, model_path)
    long_prompt = encode(tokenizer, tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about the sea and the sky, please."}], tokenize=False,
        add_generation_prompt=True))
    words = encode(tokenizer, "The sea is blue and the sky is wide.<|im_end|>")
    long = AgentLoopOutput(
        prompt_ids=long_prompt, response_ids=words, response_mask=[1] * len(words),
        response_logprobs=hf_log_probs(model_path, long_prompt, words, 0.7), num_turns=2,
    )
    long_prompt_messages = [
        {"role": "user", "content": "Tell me about the sea and the sky, please."}
    ]
    return save_verifiable(
        tmp_path_factory.mktemp("verify") / "ok", [short, long], [prompt, long_prompt_messages]
    )


def test_verify_passes_on_exact_log_probs_and_template(verifiable: Path, model_path: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        ["verify", str(verifiable), "--model", model_path, "--temperature", "0.7"], capsys
    )
    assert code == 0, out
    assert "2 trajectories" in out and "0 tokens over --atol" in out
    assert (
        "1 conversations, 1 tool/user turns (mask 0) checked; 0 mismatches" in out
        and "PASSED" in out
    )


def test_verify_fails_at_the_wrong_temperature(verifiable: Path, model_path: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        ["verify", str(verifiable), "--model", model_path, "--temperature", "1.0"], capsys
    )
    assert code == 3 and "FAILED" in out


def test_verify_fails_on_a_corrupted_log_prob_and_names_it(
    verifiable: Path, tmp_path: Path, model_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from agentloop.batch.protocol import DataProto

    data = DataProto.load_from_disk(str(verifiable / "rollout.dataproto"))
    assert data.batch is not None
    data.batch["rollout_log_probs"][1, 3] += 0.01
    (tmp_path / "bad").mkdir()
    data.save_to_disk(str(tmp_path / "bad" / "rollout.dataproto"))
    code, out, _ = run_cli(
        ["verify", str(tmp_path / "bad"), "--model", model_path, "--temperature", "0.7"], capsys
    )
    assert code == 3 and "1 tokens over --atol" in out and "row 1 response position 3" in out


def test_verify_fails_when_a_tool_turn_is_not_the_templates(
    tmp_path: Path, tokenizer: Any, model_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    wrong = calculator_trajectory(tokenizer, model_path, tool_result="6")  # the conversation says 5
    out_dir = save_verifiable(
        tmp_path / "tpl", [wrong], [[{"role": "user", "content": "Calculate 2 + 3."}]]
    )
    code, out, _ = run_cli(
        ["verify", str(out_dir), "--model", model_path, "--temperature", "0.7"], capsys
    )
    assert code == 3 and "1 mismatches" in out and "6" in out.split("row 0:")[1]


def test_verify_bad_input_is_one_line_exit_2(tmp_path: Path, verifiable: Path, model_path: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    no_lp = save_rollout(tmp_path / "nolp", synthetic_outputs(), log_probs=False)
    code, _, err = run_cli(["verify", str(no_lp), "--model", model_path], capsys)
    assert code == 2 and "calculate_log_probs=true" in err and err.count("\n") == 1
    small = tmp_path / "small-model"
    small.mkdir()
    config = json.loads((Path(model_path) / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 40}))
    code, _, err = run_cli(["verify", str(verifiable), "--model", str(small)], capsys)
    assert code == 2 and "vocabulary of 40 ids" in err and err.count("\n") == 1
    code, _, err = run_cli(
        ["verify", str(verifiable), "--model", str(tmp_path / "nowhere")], capsys
    )
    assert code == 2 and "not a local HF model directory" in err
    code, _, err = run_cli(["verify", str(tmp_path / "nowhere"), "--model", model_path], capsys)
    assert code == 2 and "agentloop rollout" in err
