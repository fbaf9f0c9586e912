"""Images through the real engine: tool_agent on vLLM CPU with the tiny Qwen2-VL model.

One manager (1 server, 1 worker, fp32, greedy) is shared by the module.  Checks: the engine sees the
pixels (same prompt, red vs blue image: different tokens / log-probs), tool images are appended and
reach the engine, the ids equal the processor's rendering of the whole conversation, and
``position_ids`` are verl's [B, 4, L] with rows 1-3 equal to the model's own ``get_rope_index``.  A
gateway session (``openai_agent``) sending a data-URL image through the openai SDK gets the same:
the engine sees its pixels and the row's ids and ``multi_modal_inputs`` are exact (HF recomputes the
engine's log-probs).

Without torchvision (our CPU machines) vLLM and the worker use the image-only Qwen2-VL processor of
:mod:`agentloop.servers.vllm_plugin` (a vLLM general plugin).
"""

from __future__ import annotations

import base64
import io
import json
import os
import sys
from typing import Any

import numpy as np
import openai
import pytest
import torch
from omegaconf import OmegaConf

from agentloop.batch.data import rows_to_batch
from agentloop.config import default_config
from agentloop.gateway.framework import register_agent_runner
from agentloop.gateway.images import data_url
from agentloop.loops.base import register
from agentloop.loops.tool_agent import ToolAgentLoop
from agentloop.parsers.base import FunctionCall

pytestmark = pytest.mark.integration

PROMPT_LEN, RESPONSE_LEN = 256, 64
TOOL_FILE = '''
from PIL import Image
from agentloop.tools import ToolResponse, function_tool


@function_tool
def draw(colour: str) -> ToolResponse:
    """Draw a square of one colour."""
    return ToolResponse(text=f"a {colour} square", image=[Image.new("RGB", (56, 56), colour)])
'''


class DrawOnce:
    """A parser that reads every assistant turn as a call of ``draw`` (the random model never calls
    tools by itself): turn 1 runs the tool, turn 2 ends the rollout at ``max_assistant_turns``
    (status max_turns)."""

    async def extract_tool_calls(
        self, response_ids: list[int], tools: Any
    ) -> tuple[str, list[FunctionCall]]:
        return "", [
            FunctionCall(name="draw", arguments=json.dumps({"colour": "green"}), id="call_draw")
        ]


class DrawingAgent(ToolAgentLoop):
    """tool_agent whose turns are one sampled token each (every id stops the engine; the random
    model would not stop by itself) and always call ``draw`` (:class:`DrawOnce`)."""

    @classmethod
    def init_class(
        cls, config: Any, tokenizer: Any, processor: Any | None = None, **kwargs: Any
    ) -> None:
        super().init_class(config, tokenizer, processor, **kwargs)
        cls.tool_parser = DrawOnce()  # type: ignore[assignment]

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        every_id = list(range(len(self.tokenizer)))
        return await super().run({**sampling_params, "stop_token_ids": every_id}, **kwargs)


def square_url(colour: str) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (56, 56), colour).save(buf, format="PNG")
    return data_url("image/png", base64.b64encode(buf.getvalue()).decode())


def image_question(colour: str) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": square_url(colour)}},
                {"type": "text", "text": "What colour is it?"},
            ],
        }
    ]


async def sdk_image_agent(*, base_url: str, api_key: str, raw_prompt: list, **fields: Any) -> float:
    """An unmodified openai-SDK agent: one chat request with the sample's square as a data URL."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(
        model="m", messages=image_question(fields["extra_info"]["colour"]), max_tokens=8
    )
    return 0.0


@pytest.fixture(scope="module")
def model_path() -> str:
    from agentloop.testing.tiny_vl_model import ensure_tiny_vl_model

    return str(ensure_tiny_vl_model())


@pytest.fixture(scope="module")
def processor(model_path):
    from agentloop.testing.tiny_vl_model import load_vl_processor

    return load_vl_processor(model_path)


@pytest.fixture(scope="module")
def hf_model(model_path):
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(model_path).eval()


@pytest.fixture(scope="module")
def tool_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "draw_tool.py"
    path.write_text(TOOL_FILE)
    return path


@pytest.fixture(scope="module")
def schemas(tool_file) -> list[dict[str, Any]]:
    """The tool schemas tool_agent renders into the prompt (its rule: only the keys the schema
    was given)."""
    from agentloop.tools.registry import load_all_tools

    return [t.tool_schema.model_dump(exclude_unset=True, exclude_none=True)
            for t in load_all_tools(function_tool_path=tool_file)]


@pytest.fixture(scope="module")
def manager(model_path, tool_file):
    import ray
    import ray.cloudpickle

    from agentloop.loops.base import _agent_loop_registry
    from agentloop.rollout.manager import AgentLoopManager

    register("it_drawing_agent")(DrawingAgent)  # only while this module's manager lives
    register_agent_runner("it_sdk_image_agent")(sdk_image_agent)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    cfg = default_config()
    for k, v in {
        "actor_rollout_ref.model.path": model_path, "data.max_prompt_length": PROMPT_LEN,
        "data.max_response_length": RESPONSE_LEN, "actor_rollout_ref.rollout.dtype": "float32",
        "actor_rollout_ref.rollout.temperature": 0,
        "actor_rollout_ref.rollout.calculate_log_probs": True,
        "actor_rollout_ref.rollout.free_cache_engine": False,
        # eager: ~10 s less per CPU engine start (compiled, the default: test_vllm_envs CLI test)
        "actor_rollout_ref.rollout.enforce_eager": True,
        "actor_rollout_ref.rollout.max_num_seqs": 8,
        "actor_rollout_ref.rollout.agent.num_workers": 1,
        "actor_rollout_ref.rollout.server.num_servers": 1,
        "actor_rollout_ref.rollout.server.device": "cpu",
        "actor_rollout_ref.rollout.multi_turn.function_tool_path": str(tool_file),
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 2,
        "actor_rollout_ref.rollout.multi_turn.return_messages": True,
    }.items():
        OmegaConf.update(cfg, k, v)
    m = AgentLoopManager(cfg)
    yield m
    m.shutdown()
    ray.shutdown()
    _agent_loop_registry.pop("it_drawing_agent", None)
    _agent_loop_registry.pop("it_sdk_image_agent", None)


def rows(colours: list[str], agent_name: str = "tool_agent") -> list[dict[str, Any]]:
    from PIL import Image

    prompt = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}],
        }
    ]
    return [{"prompt": prompt, "agent_name": agent_name,
             "multi_modal_data": {"image": [Image.new("RGB", (56, 56), c)]}} for c in colours]


def check_layout(out, processor, hf_model, schemas) -> None:
    """Position ids == get_rope_index (rows 1-3) and verl's text row; prompt ids == the
    processor's rendering."""
    ids, mask, pos = out.batch["input_ids"], out.batch["attention_mask"], out.batch["position_ids"]
    assert pos.shape == (len(out), 4, ids.shape[1])
    grids = [
        g
        for mm in out.non_tensor_batch["multi_modal_inputs"]
        for g in mm["image_grid_thw"].tolist()
    ]
    kinds = (ids == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")).long()
    expected, _ = hf_model.model.get_rope_index(
        ids, kinds, image_grid_thw=torch.tensor(grids), attention_mask=mask
    )
    assert torch.equal(pos[:, 1:], expected.transpose(0, 1))
    prompt_len = out.batch["prompts"].shape[1]
    for r in range(len(out)):
        valid = mask[r].bool()
        assert pos[r, 0, valid].tolist() == list(range(int(valid.sum())))
        messages = list(out.non_tensor_batch["messages"][r])
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
        text = processor.tokenizer.apply_chat_template(
            messages[:first], tools=schemas, tokenize=False, add_generation_prompt=True
        )
        image = out.non_tensor_batch["multi_modal_data"][r]["image"][:1]
        want = processor(text=[text], images=image, return_tensors="pt")["input_ids"][0].tolist()
        assert ids[r, :prompt_len][mask[r, :prompt_len].bool()].tolist() == want


def test_the_engine_sees_the_image(manager, processor, hf_model, schemas):
    out = manager.generate_sequences(rows_to_batch(rows(["red", "blue", "red"])))
    assert "error" not in set(out.non_tensor_batch["status"]), out.non_tensor_batch.get("error")
    logprobs = out.batch["rollout_log_probs"]
    responses = out.batch["responses"]
    # greedy: same image
    assert torch.equal(responses[0], responses[2]) and torch.equal(logprobs[0], logprobs[2])
    assert not torch.equal(logprobs[0], logprobs[1])  # other pixels, other output
    check_layout(out, processor, hf_model, schemas)


def test_tool_images_reach_the_engine_with_exact_tokens(manager, processor, hf_model, schemas):
    out = manager.generate_sequences(
        rows_to_batch(rows(["red", "blue"], agent_name="it_drawing_agent"))
    )
    assert list(out.non_tensor_batch["status"]) == ["max_turns", "max_turns"], (
        out.non_tensor_batch.get("error")
    )
    for cell in out.non_tensor_batch["multi_modal_data"]:
        assert len(cell["image"]) == 2 and np.asarray(cell["image"][1])[0, 0].tolist() == [
            0, 128, 0,
        ]
    for mm in out.non_tensor_batch["multi_modal_inputs"]:
        assert mm["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]
    check_layout(out, processor, hf_model, schemas)
    tok, pad = processor.tokenizer, processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    green = out.non_tensor_batch["multi_modal_data"][0]["image"][1]
    prompt_len = out.batch["prompts"].shape[1]
    # the tool turn (mask 0) is what the processor makes of its text and image
    for r in range(len(out)):
        sent = out.batch["attention_mask"][r, prompt_len:].bool() & (
            out.batch["response_mask"][r] == 0
        )
        turn = out.batch["responses"][r][sent].tolist()
        # one pad per image
        once = [t for i, t in enumerate(turn) if t != pad or turn[i - 1] != pad]
        text = tok.decode(once)
        assert "<tool_response>" in text and "a green square" in text and turn.count(pad) == 4
        assert (
            turn
            == processor(text=[text], images=[green], return_tensors="pt")["input_ids"][0].tolist()
        )


def test_without_torchvision_a_video_sample_is_an_error_row_naming_the_fix(manager):
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: the engine takes videos")
    batch = rows_to_batch(rows(["red", "red"]))
    batch.non_tensor_batch["multi_modal_data"][1] = {
        "image": batch.non_tensor_batch["multi_modal_data"][1]["image"],
        "video": [np.zeros((2, 56, 56, 3), dtype=np.uint8)],
    }
    out = manager.generate_sequences(batch)
    assert out.non_tensor_batch["status"][0] != "error", out.non_tensor_batch["error"][0]
    assert out.non_tensor_batch["status"][1] == "error"
    assert "install a torchvision build matching torch" in out.non_tensor_batch["error"][1]


def test_verify_recomputes_image_rows_with_their_pixels(manager, hf_model):
    """`agentloop verify`'s recompute on image rows: the engine's log-probs equal HF Qwen2-VL's
    given each row's own pixels (M-RoPE from its grid), and differ once the rows' images are
    swapped."""
    from agentloop.report.verify import Sampling, VerifyResult, recompute

    out = manager.generate_sequences(rows_to_batch(rows(["red", "blue"])))
    result = VerifyResult()
    recompute(hf_model, out, Sampling(), result)
    print(
        f"\nimage rows: {result.rows}, {result.tokens} tokens, max |vLLM - HF| "
        f"{result.deltas.max():.2e}"
    )
    assert result.rows == 2 and result.tokens > 0 and result.deltas.max() < 1e-3
    out.non_tensor_batch["multi_modal_inputs"] = out.non_tensor_batch["multi_modal_inputs"][
        ::-1
    ].copy()
    swapped = VerifyResult()
    recompute(hf_model, out, Sampling(), swapped)
    assert swapped.deltas.max() > 1e-2  # the check sees the pixels: another image, other log-probs


def test_a_gateway_session_image_reaches_the_engine_with_exact_rows(manager, processor, hf_model):
    """openai SDK -> gateway (data URL) -> vLLM: greedy output equal for equal squares and different
    for another colour; each row's prompt is the processor's rendering, its multi_modal_inputs the
    processor's, its M-RoPE rows Qwen2-VL's, and HF given the row's own pixels recomputes the
    engine's log-probs.
    """
    from agentloop.report.verify import Sampling, VerifyResult, recompute

    colours = ["red", "blue", "red"]
    batch = rows_to_batch(
        [
            {
                "prompt": [{"role": "user", "content": "look"}], "agent_name": "it_sdk_image_agent",
                "extra_info": {"colour": c},
            }
            for c in colours
        ]
    )
    out = manager.generate_sequences(batch)
    assert set(out.non_tensor_batch["status"]) <= {"stop", "length"}, out.non_tensor_batch.get(
        "error"
    )
    logprobs, responses = out.batch["rollout_log_probs"], out.batch["responses"]
    assert torch.equal(responses[0], responses[2]) and torch.equal(logprobs[0], logprobs[2])
    assert not torch.equal(logprobs[0], logprobs[1])  # the engine saw other pixels
    ids, mask, pos = out.batch["input_ids"], out.batch["attention_mask"], out.batch["position_ids"]
    prompt_len = out.batch["prompts"].shape[1]
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for r, colour in enumerate(colours):
        text = processor.tokenizer.apply_chat_template(image_question(colour), tokenize=False,
                                                       add_generation_prompt=True)
        image = out.non_tensor_batch["multi_modal_data"][r]["image"]
        assert (
            np.asarray(image[0])[0, 0].tolist() == {"red": [255, 0, 0], "blue": [0, 0, 255]}[colour]
        )
        want = processor(text=[text], images=image, return_tensors="pt")
        assert (
            ids[r, :prompt_len][mask[r, :prompt_len].bool()].tolist()
            == want["input_ids"][0].tolist()
        )
        mm = out.non_tensor_batch["multi_modal_inputs"][r]
        assert torch.equal(mm["pixel_values"], want["pixel_values"])
        assert mm["image_grid_thw"].tolist() == want["image_grid_thw"].tolist() == [[1, 4, 4]]
    grids = [
        g
        for mm in out.non_tensor_batch["multi_modal_inputs"]
        for g in mm["image_grid_thw"].tolist()
    ]
    expected, _ = hf_model.model.get_rope_index(
        ids, (ids == pad).long(), image_grid_thw=torch.tensor(grids), attention_mask=mask
    )
    assert torch.equal(pos[:, 1:], expected.transpose(0, 1))
    result = VerifyResult()
    recompute(hf_model, out, Sampling(), result)
    print(
        f"\ngateway image rows: {result.rows}, {result.tokens} tokens, max |vLLM - HF| "
        f"{result.deltas.max():.2e}"
    )
    assert result.rows == 3 and result.tokens > 0 and result.deltas.max() < 1e-3
