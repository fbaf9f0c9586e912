"""The vLLM plugin that lets Qwen2-VL checkpoints load without torchvision
(agentloop/servers/vllm_plugin.py).

What a user relies on: vLLM finds the plugin (entry point), vLLM's Qwen2-VL import (``smart_resize``
from the torchvision image-processing module) works, ``AutoProcessor`` gives a processor that
renders images exactly as the PIL image processor does and refuses videos naming the fix, the engine
is started without video inputs for Qwen2-VL only, and none of it happens where torchvision is
installed.
"""

from __future__ import annotations

import importlib
import json
from importlib.metadata import entry_points

import pytest
from PIL import Image

from agentloop.servers import vllm_plugin
from agentloop.servers.vllm import engine_args
from agentloop.testing.tiny_vl_model import ensure_tiny_vl_model

needs_no_torchvision = pytest.mark.skipif(
    vllm_plugin.torchvision_available(), reason="torchvision is installed: the plugin does nothing"
)


@pytest.fixture(scope="module")
def vl_path() -> str:
    return str(ensure_tiny_vl_model())


def test_vllm_finds_the_plugin_through_its_entry_point():
    found = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert found.get("agentloop_qwen2_vl") == "agentloop.servers.vllm_plugin:register"


@needs_no_torchvision
def test_vllms_qwen2_vl_import_and_auto_processor_work_without_torchvision(vl_path):
    from transformers import AutoProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vllm_plugin.install()
    module = importlib.import_module("transformers.models.qwen2_vl.image_processing_qwen2_vl")
    assert module.smart_resize(56, 56, factor=28, min_pixels=784, max_pixels=3136) == (56, 56)
    processor = AutoProcessor.from_pretrained(vl_path)
    assert isinstance(processor.image_processor, Qwen2VLImageProcessorPil)
    image = Image.new("RGB", (56, 56), "red")
    out = processor(
        text=["<|vision_start|><|image_pad|><|vision_end|>hi"], images=[image], return_tensors="pt"
    )
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert out["input_ids"][0].tolist().count(pad) == 4  # 56x56 -> 2x2 merged patches
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]
    json.loads(processor.to_json_string())  # repr / logging of the processor still work
    with pytest.raises(RuntimeError, match="install a torchvision build"):
        processor.video_processor(videos=[[image]])


@needs_no_torchvision
def test_qwen2_vl_engines_start_without_video_inputs_and_text_models_are_untouched(
    vl_path, tmp_path
):
    assert vllm_plugin.engine_arg_defaults(vl_path) == {"limit_mm_per_prompt": {"video": 0}}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert vllm_plugin.engine_arg_defaults(str(tmp_path)) == {}
    assert vllm_plugin.engine_arg_defaults(str(tmp_path / "missing")) == {}

    from agentloop.config import default_config, resolve_config

    cfg = default_config()
    cfg.actor_rollout_ref.model.path = vl_path
    resolved = resolve_config(cfg)
    args = engine_args(resolved.engine, resolved.server, resolved.model_config, on_cpu=True)
    assert args["limit_mm_per_prompt"] == {"video": 0}
    cfg.actor_rollout_ref.rollout.engine_kwargs.vllm = {
        "limit_mm_per_prompt": {"image": 3, "video": 0}
    }
    resolved = resolve_config(cfg)
    args = engine_args(resolved.engine, resolved.server, resolved.model_config, on_cpu=True)
    assert args["limit_mm_per_prompt"] == {"image": 3, "video": 0}  # the user's engine_kwargs win


def test_with_torchvision_installed_nothing_is_patched(vl_path, monkeypatch):
    monkeypatch.setattr(vllm_plugin, "torchvision_available", lambda: True)
    monkeypatch.setattr(vllm_plugin, "_installed", False)
    assert vllm_plugin.install() is False
    assert vllm_plugin.engine_arg_defaults(vl_path) == {}
