"""Build a tiny Qwen2-VL checkpoint locally (no model hub), for multimodal tests and examples.

:func:`ensure_tiny_vl_model` writes, in a few seconds and deterministically, a directory that
``transformers`` (``AutoProcessor``, ``Qwen2VLForConditionalGeneration``) and vLLM load like any
Qwen2-VL checkpoint: the tiny text model's tokenizer plus Qwen2-VL's vision tokens,
:data:`VL_CHAT_TEMPLATE` (image and video parts rendered as Qwen2-VL does), image / video processor
configs with small pixel bounds (:data:`MIN_PIXELS`, :data:`MAX_PIXELS`: at most 16 tokens an
image), and random fp32 weights (M-RoPE sections :data:`MROPE_SECTION`, a one-block vision tower):
its output changes with the pixels but means nothing.  Cached under
``$AGENTLOOP_CACHE_DIR/tiny-qwen2-vl`` like the text model. Spec:
docs/multimodal.md#the-tiny-vision-language-model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentloop.servers.vllm_plugin import install
from agentloop.testing.tiny_model import (
    CHAT_TEMPLATE,
    DEFAULT_NAME,
    IM_END,
    MARKER,
    MODEL_SHAPE,
    PAD_TOKEN,
    SHIPPED_DIR,
    build_in_place,
    build_tokenizer,
    content_hash,
    tiny_model_path,
)

VL_BUILDER_VERSION = "1"
VL_NAME = "tiny-qwen2-vl"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VL_SPECIAL_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 14, 2, 2
MIN_PIXELS = 56 * 56  # one 2x2 block of merged 28x28 tiles: 4 tokens
MAX_PIXELS = 112 * 112  # at most 16 tokens per image
MROPE_SECTION = [4, 6, 6]  # temporal / height / width halves of the rotary dims (head_dim 32 -> 16)
VISION_SHAPE: dict[str, Any] = {"depth": 1, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2}

_CONTENT_MACRO = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is iterable and content is not mapping -%}"
    "{%- for part in content -%}"
    "{%- if part.type == 'image' or part.type == 'image_url' or 'image' in part -%}"
    + VISION_START + IMAGE_PAD + VISION_END +
    "{%- elif part.type == 'video' or 'video' in part -%}"
    + VISION_START + VIDEO_PAD + VISION_END +
    "{%- elif part.text is defined -%}{{ part.text }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}\n"
)


def _vl_template() -> str:
    template = CHAT_TEMPLATE.replace("(message.content or '')", "render_content(message.content)")
    template = template.replace("messages[0].content", "render_content(messages[0].content)")
    template = template.replace(
        "'\\n' ~ message.content", "'\\n' ~ render_content(message.content)"
    )
    template = template.replace(
        "'\\n' ~ message.content ~", "'\\n' ~ render_content(message.content) ~"
    )
    return _CONTENT_MACRO + template


VL_CHAT_TEMPLATE = _vl_template()
"""The text model's template with Qwen2-VL image / video parts (see the module docstring)."""


def tiny_vl_model_path() -> Path:
    """Where :func:`ensure_tiny_vl_model` puts the model by default
    (``$AGENTLOOP_CACHE_DIR/tiny-qwen2-vl``)."""
    return tiny_model_path(VL_NAME)


def build_vl_tokenizer() -> Any:
    """The tiny text model's tokenizer with the Qwen2-VL special tokens and
    :data:`VL_CHAT_TEMPLATE`."""
    from transformers import AutoTokenizer  # heavy: only when building

    shipped = SHIPPED_DIR / DEFAULT_NAME
    # the tokenizer does not depend on training: the shipped copy, else the deterministic build
    # (seconds)
    tokenizer = (
        AutoTokenizer.from_pretrained(str(shipped))
        if (shipped / "tokenizer.json").is_file()
        else build_tokenizer()
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(VL_SPECIAL_TOKENS)})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def image_processor_config() -> dict[str, Any]:
    """``preprocessor_config.json``: Qwen2-VL's image processor with :data:`MIN_PIXELS` /
    :data:`MAX_PIXELS`."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "rescale_factor": 1 / 255, "resample": 3,
        "patch_size": PATCH_SIZE, "merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE, "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS, "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    }


def write_processor_files(tokenizer: Any, out_dir: Path) -> None:
    """Tokenizer, chat template, image / video processor and processor configs, as a Qwen2-VL
    checkpoint has.

    Written as JSON rather than through ``Qwen2VLProcessor.save_pretrained``: transformers 5 cannot
    build that class without torchvision (its video processor needs it), and the files are the same.
    """
    tokenizer.save_pretrained(str(out_dir))
    image = image_processor_config()
    video = {**image, "video_processor_type": "Qwen2VLVideoProcessor"}
    del video["image_processor_type"]
    files = {"preprocessor_config.json": image, "video_preprocessor_config.json": video,
             "processor_config.json": {"processor_class": "Qwen2VLProcessor"}}
    for name, data in files.items():
        (out_dir / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    (out_dir / "chat_template.jinja").write_text(VL_CHAT_TEMPLATE)


def load_vl_processor(path: str | Path) -> Any:
    """The model's ``Qwen2VLProcessor`` (``AutoProcessor``).  Without torchvision (which
    transformers 5 needs for Qwen2-VL's video processor) an image-only one
    (:mod:`agentloop.servers.vllm_plugin`): videos raise."""
    import transformers  # heavy: only when loading

    install()
    return transformers.AutoProcessor.from_pretrained(str(path))


def init_vl_model(tokenizer: Any, seed: int = 0) -> Any:
    """A randomly initialised fp32 ``Qwen2VLForConditionalGeneration`` sized to ``tokenizer``."""
    # heavy (torch, transformers): only when building
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    vocab = tokenizer.get_vocab()
    pad, eos = vocab[PAD_TOKEN], vocab[IM_END]
    text = {k: v for k, v in MODEL_SHAPE.items() if k != "tie_word_embeddings"}
    text_config = {
        **text,
        "vocab_size": (len(tokenizer) + 63) // 64 * 64,
        "bos_token_id": pad,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 1000000.0, "mrope_section": list(MROPE_SECTION),
        },
    }
    vision_config = {
        **VISION_SHAPE, "hidden_size": MODEL_SHAPE["hidden_size"], "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE, "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "in_channels": 3,
    }
    config = Qwen2VLConfig(
        text_config=text_config, vision_config=vision_config, image_token_id=vocab[IMAGE_PAD],
        video_token_id=vocab[VIDEO_PAD], vision_start_token_id=vocab[VISION_START],
        vision_end_token_id=vocab[VISION_END], tie_word_embeddings=True, dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)
    model.eval()
    return model


def build_vl_into(out_dir: Path) -> None:
    """Write tokenizer, processor configs, weights, generation config and the marker into
    ``out_dir``."""
    # heavy (transformers): only when building
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    # one tiny shard: the "Writing model shards" bar is only noise
    hf_logging.disable_progress_bar()
    tokenizer = build_vl_tokenizer()
    write_processor_files(tokenizer, out_dir)
    model = init_vl_model(tokenizer)
    model.save_pretrained(str(out_dir))
    vocab = tokenizer.get_vocab()
    pad, eos = vocab[PAD_TOKEN], vocab[IM_END]
    GenerationConfig(bos_token_id=pad, eos_token_id=eos, pad_token_id=pad).save_pretrained(
        str(out_dir)
    )
    tokenizer_config = out_dir / "tokenizer_config.json"
    data = json.loads(tokenizer_config.read_text())
    data["tokenizer_class"] = "Qwen2Tokenizer"
    tokenizer_config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    for file in out_dir.iterdir():
        file.chmod(0o644)
    marker = {
        "builder_version": f"vl-{VL_BUILDER_VERSION}", "content_sha256": content_hash(out_dir),
        "vocab": len(tokenizer),
    }
    (out_dir / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")


def _is_current(path: Path) -> bool:
    try:
        marker = json.loads((path / MARKER).read_text())
        return (marker.get("builder_version") == f"vl-{VL_BUILDER_VERSION}"
                and marker.get("content_sha256") == content_hash(path))
    except (OSError, ValueError):
        return False


def ensure_tiny_vl_model(path: str | Path | None = None, *, force: bool = False) -> Path:
    """Build the tiny Qwen2-VL model at ``path`` (default :func:`tiny_vl_model_path`) unless it is
    current.

    Idempotent and safe to call from parallel processes (file lock, build into a temporary
    directory, atomic rename).  ``force`` rebuilds.  Raises ``FileExistsError`` rather than replace
    a non-empty directory that holds no tiny model.
    """
    target = Path(path).expanduser().absolute() if path is not None else tiny_vl_model_path()
    return build_in_place(target, build_vl_into, _is_current, force=force)
