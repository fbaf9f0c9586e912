"""Images through tool_agent with the tiny Qwen2-VL model: processor rendering, M-RoPE ids, bad
input.

No engine: a ScriptedServer records what the loop sends.  The model itself (transformers) is only
used for its ``get_rope_index`` and to check that it sees the pixels.
"""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from agentloop.batch.multimodal import (
    ImageDecodeError,
    add_multimodal_outputs,
    decode_image,
    engine_prompt,
    expand_image_pads,
    mrope_position_ids,
)
from agentloop.batch.postprocess import postprocess
from agentloop.config import default_config
from agentloop.errors import ConfigError, DatasetError
from agentloop.loops.tool_agent import ToolAgentLoop
from agentloop.routing import AsyncLLMServerManager
from agentloop.testing import ScriptedServer
from agentloop.testing.tiny_vl_model import ensure_tiny_vl_model, load_vl_processor
from agentloop.tools import BaseTool, ToolResponse


class PictureTool(BaseTool):
    """Returns one small image whose colour the call names."""

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[Any, float, dict]:
        colour = str(parameters.get("colour", "blue"))
        return (
            ToolResponse(text=f"a {colour} square", image=[Image.new("RGB", (56, 56), colour)]),
            0.0, {},
        )


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    path = ensure_tiny_vl_model(tmp_path_factory.mktemp("models") / "tiny-qwen2-vl")
    processor = load_vl_processor(path)
    return SimpleNamespace(path=path, processor=processor, tok=processor.tokenizer)


@pytest.fixture(scope="module")
def model(vl):
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(str(vl.path)).eval()


@pytest.fixture
def tool_yaml(tmp_path) -> Path:
    path = tmp_path / "tools.yaml"
    path.write_text(
        f"tools:\n  - class_name: {__name__}.PictureTool\n    tool_schema: "
        f"{{type: function, function: "
        "{name: draw, description: draw a square, parameters: {type: object, "
        "properties: "
        "{colour: {type: string}}}}}\n"
    )
    return path


def say(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]


def call(name: str, **args: Any) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def run_loop(vl, tool_yaml: Path, script: list[list[int]], processor: Any = "vl", **sample: Any):
    cfg = default_config()
    cfg.data.max_prompt_length = 512
    cfg.data.max_response_length = 400
    OmegaConf.resolve(cfg)
    rollout = cfg.actor_rollout_ref.rollout
    rollout.multi_turn.tool_config_path = str(tool_yaml)
    rollout.multi_turn.return_messages = True
    server = ScriptedServer(script, eos_token_id=vl.tok.convert_tokens_to_ids("<|im_end|>"))
    proc = vl.processor if processor == "vl" else processor

    async def go():
        ToolAgentLoop.init_class(cfg, vl.tok, proc)
        loop = ToolAgentLoop(cfg, AsyncLLMServerManager([server]), vl.tok, proc)
        return await loop.run({}, **sample)

    return asyncio.run(go()), server


def image_prompt(text: str = "What colour is this?") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def test_tiny_vl_model_loads_in_transformers_and_sees_the_pixels(vl, model):
    text = vl.tok.apply_chat_template(image_prompt(), tokenize=False, add_generation_prompt=True)
    assert "<|vision_start|><|image_pad|><|vision_end|>What colour" in text
    logits = []
    for colour in ("red", "blue"):
        inputs = vl.processor(
            text=[text], images=[Image.new("RGB", (56, 56), colour)], return_tensors="pt"
        )
        # 16 patches, 4 tokens after the 2x2 merge
        assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
        assert (
            int((inputs["input_ids"] == vl.tok.convert_tokens_to_ids("<|image_pad|>")).sum()) == 4
        )
        with torch.no_grad():
            logits.append(model(**inputs).logits[0, -1])
    assert not torch.allclose(logits[0], logits[1])


def test_the_build_is_cached_with_small_pixel_bounds(vl):
    marker = vl.path / "agentloop_tiny_model.json"
    before = marker.stat().st_mtime_ns
    # current: untouched
    assert ensure_tiny_vl_model(vl.path) == vl.path and marker.stat().st_mtime_ns == before
    config = json.loads((vl.path / "preprocessor_config.json").read_text())
    assert config["merge_size"] == 2 and config["size"] == {
        "shortest_edge": 56 * 56,
        "longest_edge": 112 * 112,
    }


def test_prompt_and_tool_images_are_rendered_as_the_processor_renders_them(vl, tool_yaml):
    tok = vl.tok
    script = [say(tok, call("draw", colour="green")), say(tok, "It is red.")]
    red = Image.new("RGB", (56, 56), "red")
    out, server = run_loop(
        vl, tool_yaml, script, raw_prompt=image_prompt(), multi_modal_data={"image": [red]}
    )
    assert out.status == "stop" and len(out.multi_modal_data["image"]) == 2
    images = out.multi_modal_data["image"]
    # the whole conversation through the processor == what the engine got, token for token
    text = tok.apply_chat_template(
        out.extra_fields["messages"], tools=ToolAgentLoop.tool_schemas, tokenize=False
    )
    expected = vl.processor(text=[text], images=images, return_tensors="pt")["input_ids"][
        0
    ].tolist()
    ids = out.prompt_ids + out.response_ids
    assert ids == expected[:len(ids)] and tok.decode(expected[len(ids):]) == "\n"
    second = server.calls[1]
    assert (
        second["prompt_ids"] == ids[: len(second["prompt_ids"])] and len(second["image_data"]) == 2
    )
    assert np.array_equal(
        np.asarray(second["image_data"][1]), np.asarray(Image.new("RGB", (56, 56), "green"))
    )


def padded_batch(vl, tool_yaml):
    """Two rows: one with a prompt image and a tool image, one text-only (different lengths:
    padding)."""
    tok = vl.tok
    with_images, _ = run_loop(
        vl, tool_yaml, [say(tok, call("draw", colour="green")), say(tok, "Red.")],
        raw_prompt=image_prompt(), multi_modal_data={"image": [Image.new("RGB", (56, 84), "red")]},
    )
    text_only, _ = run_loop(vl, tool_yaml, [say(tok, "Hello there, friend.")], raw_prompt="Hi")
    batch = postprocess([with_images, text_only], prompt_length=512, response_length=400,
                        pad_token_id=tok.pad_token_id)
    return add_multimodal_outputs(batch, vl.processor)


def test_position_ids_have_verls_layout_and_equal_get_rope_index(vl, tool_yaml, model):
    batch = padded_batch(vl, tool_yaml)
    ids, mask, pos = (
        batch.batch["input_ids"], batch.batch["attention_mask"], batch.batch["position_ids"],
    )
    assert pos.shape == (2, 4, ids.shape[1])
    mm = batch.non_tensor_batch["multi_modal_inputs"]
    # PIL sizes are (w, h)
    assert mm[1] == {} and mm[0]["image_grid_thw"].tolist() == [[1, 6, 4], [1, 4, 4]]
    assert mm[0]["pixel_values"].shape[0] == 24 + 16
    kinds = torch.zeros_like(ids)
    kinds[ids == vl.tok.convert_tokens_to_ids("<|image_pad|>")] = 1
    expected, _ = model.model.get_rope_index(
        ids, kinds, image_grid_thw=mm[0]["image_grid_thw"], attention_mask=mask
    )
    assert torch.equal(pos[:, 1:], expected.transpose(0, 1))
    for r in range(2):  # row 0: verl's text positions (arange over attended tokens, 1 on padding)
        valid = mask[r].bool()
        assert pos[r, 0, valid].tolist() == list(range(int(valid.sum())))
        assert set(pos[r, 0, ~valid].tolist()) <= {1}
    # text-only row
    assert pos[1, 1:, mask[1].bool()].tolist() == [pos[1, 0, mask[1].bool()].tolist()] * 3


def test_mrope_positions_after_an_image_restart_at_max_h_w():
    ids = [7, 9, 9, 9, 9, 9, 9, 8, 3]  # text, a 2x3-token image (grid 1x4x6, merge 2), text
    pos = mrope_position_ids(
        ids, [1] * len(ids), image_token_id=9, video_token_id=None, image_grid_thw=[[1, 4, 6]]
    )
    assert pos[1:, 1:7].tolist() == [[1] * 6, [1, 1, 1, 2, 2, 2], [1, 2, 3, 1, 2, 3]]
    assert pos[1:, 7].tolist() == [4, 4, 4]  # 1 + max(2, 3)


def test_expand_image_pads_refuses_images_without_placeholders():
    assert expand_image_pads([1, 5, 2, 5], 5, [2, 3]) == [1, 5, 5, 2, 5, 5, 5]
    with pytest.raises(DatasetError, match="1 image placeholder.*2 image"):
        expand_image_pads([1, 5], 5, [2, 3])


def test_images_are_decoded_from_the_forms_datasets_hold(tmp_path):
    buf = io.BytesIO()
    Image.new("L", (8, 8), 128).save(buf, format="PNG")
    path = tmp_path / "x.png"
    path.write_bytes(buf.getvalue())
    for form in (buf.getvalue(), {"bytes": buf.getvalue()}, {"path": str(path)}, str(path)):
        image = decode_image(form)
        assert image.mode == "RGB" and image.size == (8, 8)


def test_an_undecodable_sample_image_fails_that_sample_with_the_reason(vl, tool_yaml):
    with pytest.raises(ImageDecodeError, match="sample image 1 could not be decoded.*PNG/JPEG"):
        run_loop(vl, tool_yaml, [say(vl.tok, "x")], raw_prompt=image_prompt(),
                 multi_modal_data={"image": [Image.new("RGB", (56, 56)), b"not an image"]})


def test_more_images_than_image_parts_is_a_clear_error(vl, tool_yaml):
    with pytest.raises(DatasetError, match="placeholder"):
        run_loop(vl, tool_yaml, [say(vl.tok, "x")], raw_prompt="no image part here",
                 multi_modal_data={"image": [Image.new("RGB", (56, 56))]})


def test_images_for_a_text_only_engine_are_refused_naming_the_fix():
    text_only = SimpleNamespace(is_multimodal_model=False, model="tiny-qwen2")
    with pytest.raises(ConfigError, match="text-only: serve a vision-language model"):
        engine_prompt([1, 2], [Image.new("RGB", (4, 4))], None, text_only)
    assert "multi_modal_data" not in engine_prompt([1, 2], None, None, text_only)
    vl_config = SimpleNamespace(
        is_multimodal_model=True, hf_config=SimpleNamespace(image_token_id=9, video_token_id=8)
    )
    prompt = engine_prompt(
        [1, 9, 9, 9, 2, 8, 8, 9], [{"bytes": _png()}, _png()], ["frames"], vl_config
    )
    assert prompt["multi_modal_data"]["image"][0].mode == "RGB" and prompt["multi_modal_data"][
        "video"
    ] == ["frames"]
    # the engine expands each placeholder itself (as verl)
    assert prompt["prompt_token_ids"] == [1, 9, 2, 8, 9]
    limits = SimpleNamespace(get_limit_per_prompt=lambda m: 0 if m == "video" else 9)
    no_videos = SimpleNamespace(**vars(vl_config), multimodal_config=limits)
    with pytest.raises(
        ConfigError, match="install a torchvision build matching torch, or drop video_data"
    ):
        engine_prompt([1, 8, 2], None, ["frames"], no_videos)
    assert (
        engine_prompt([1, 9, 2], [_png()], None, no_videos)["multi_modal_data"]["image"][0].mode
        == "RGB"
    )


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, format="PNG")
    return buf.getvalue()


class VideoServer(ScriptedServer):
    """A scripted server that takes ``video_data`` as the vLLM server does, and records it."""

    async def generate(
        self, prompt_ids, sampling_params, request_id, image_data=None, video_data=None
    ):
        self.videos = [*getattr(self, "videos", []), video_data]
        return await super().generate(prompt_ids, sampling_params, request_id, image_data)


def test_sample_videos_are_passed_through_the_router_as_video_data(vl, tool_yaml):
    tok = vl.tok
    cfg = default_config()
    OmegaConf.resolve(cfg)
    cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path = str(tool_yaml)
    server = VideoServer(
        [say(tok, "A video.")], eos_token_id=tok.convert_tokens_to_ids("<|im_end|>")
    )
    frames = [np.zeros((2, 56, 56, 3), dtype=np.uint8)]

    async def go():
        ToolAgentLoop.init_class(cfg, tok, vl.processor)
        loop = ToolAgentLoop(cfg, AsyncLLMServerManager([server]), tok, vl.processor)
        return await loop.run(
            {},
            raw_prompt=[
                {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What?"}]}
            ],
            multi_modal_data={"video": frames},
        )

    out = asyncio.run(go())
    assert out.status == "stop" and server.videos == [frames]
    # expanded by the engine
    assert out.prompt_ids.count(tok.convert_tokens_to_ids("<|video_pad|>")) == 1
    # a server without the keyword says so
    with pytest.raises(NotImplementedError, match="video_data"):
        asyncio.run(
            AsyncLLMServerManager([ScriptedServer([[1]])]).generate(
                "r", prompt_ids=[1], sampling_params={}, video_data=frames
            )
        )


def test_worker_output_has_verls_multimodal_layout_and_keeps_a_failed_sample(vl):
    from agentloop.batch.protocol import DataProto
    from agentloop.rollout.worker import AgentLoopWorker

    tok = vl.tok
    cfg = default_config()
    cfg.data.max_prompt_length, cfg.data.max_response_length = 64, 16
    OmegaConf.resolve(cfg)
    server = ScriptedServer(
        lambda ids, params, rid: say(tok, "Red."),
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
    )
    worker = AgentLoopWorker.from_slices(
        cfg.actor_rollout_ref.rollout, OmegaConf.create({"path": str(vl.path)}), [server],
        tokenizer=tok, processor=vl.processor,
    )
    n = 3
    prompts, mm = np.empty(n, dtype=object), np.empty(n, dtype=object)
    prompts[:] = [image_prompt(), image_prompt(), [{"role": "user", "content": "no image"}]]
    mm[:] = [{"image": [Image.new("RGB", (56, 56), "red")]}, {"image": [b"\x89PNG broken"]}, None]
    batch = DataProto(
        batch=None,
        meta_info={},
        non_tensor_batch={
            "raw_prompt": prompts, "multi_modal_data": mm,
            "agent_name": np.array(["tool_agent"] * n, dtype=object),
            "uid": np.array(["a", "b", "c"], dtype=object), "index": np.arange(n),
        },
    )
    out = asyncio.run(worker.generate_sequences(batch))
    status, error = out.non_tensor_batch["status"], out.non_tensor_batch["error"]
    assert (
        list(status) == ["stop", "error", "stop"]
        and "sample image 0 could not be decoded" in error[1]
    )
    assert out.batch["position_ids"].shape == (n, 4, 64 + 16)
    inputs = out.non_tensor_batch["multi_modal_inputs"]
    assert (
        inputs[0]["image_grid_thw"].tolist() == [[1, 4, 4]] and inputs[1] == {} and inputs[2] == {}
    )
    ids = out.batch["input_ids"][0][out.batch["attention_mask"][0].bool()].tolist()
    assert ids.count(tok.convert_tokens_to_ids("<|image_pad|>")) == 4


def test_single_turn_agent_renders_and_sends_sample_images_as_tool_agent_does(vl):
    from agentloop.loops.single_turn import SingleTurnAgentLoop

    cfg = default_config()
    cfg.data.max_prompt_length, cfg.data.max_response_length = 256, 16
    OmegaConf.resolve(cfg)
    server = ScriptedServer(
        [say(vl.tok, "red")], eos_token_id=vl.tok.convert_tokens_to_ids("<|im_end|>")
    )
    image = Image.new("RGB", (56, 56), "red")

    async def go():
        SingleTurnAgentLoop.init_class(cfg, vl.tok, vl.processor)
        loop = SingleTurnAgentLoop(cfg, AsyncLLMServerManager([server]), vl.tok, vl.processor)
        return await loop.run(
            {}, raw_prompt=image_prompt(), multi_modal_data={"image": [{"bytes": _png_of(image)}]}
        )

    out = asyncio.run(go())
    text = vl.tok.apply_chat_template(image_prompt(), tokenize=False, add_generation_prompt=True)
    assert (
        out.prompt_ids
        == vl.processor(text=[text], images=[image], return_tensors="pt")["input_ids"][0].tolist()
    )
    sent = server.calls[-1]["image_data"]
    assert (
        len(sent) == 1
        and sent[0].mode == "RGB"
        and np.asarray(sent[0])[0, 0].tolist() == [255, 0, 0]
    )
    assert out.multi_modal_data is not None and len(out.multi_modal_data["image"]) == 1


def _png_of(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_verl_dataset_columns_become_multi_modal_data_and_content_parts():
    from agentloop.batch.data import media_columns

    row = {
        "prompt": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "<image>Which?<image>"},
        ],
        "images": [{"bytes": b"a"}, {"bytes": b"b"}],
        "data_source": "x",
    }
    out = media_columns(row)
    assert (
        out["multi_modal_data"] == {"image": [{"bytes": b"a"}, {"bytes": b"b"}]}
        and "images" not in out
    )
    assert out["prompt"][0] == {"role": "system", "content": "be brief"}
    assert out["prompt"][1]["content"] == [
        {"type": "image"}, {"type": "text", "text": "Which?"}, {"type": "image"},
    ]
    parquet_parts = {
        "prompt": [
            {
                "role": "user",
                "content": [{"type": "image", "text": None}, {"type": "text", "text": "hi"}],
            }
        ],
        "images": [b"x"],
    }
    assert media_columns(parquet_parts)["prompt"][0]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "hi"},
    ]
    assert media_columns({"prompt": [], "videos": ["v"]})["multi_modal_data"] == {"video": ["v"]}
    plain = {"prompt": [{"role": "user", "content": "<image> stays text without an images column"}]}
    assert media_columns(plain) is plain
    assert media_columns(row, image_key=None) is row  # data.image_key: null reads no image column
