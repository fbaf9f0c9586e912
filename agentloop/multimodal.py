"""The documented import path of :mod:`agentloop.batch.multimodal` (re-exports only)."""

from agentloop.batch.multimodal import (  # noqa: F401
    IMAGE_PAD,
    MROPE_PROCESSORS,
    VIDEO_PAD,
    ImageDecodeError,
    add_multimodal_outputs,
    collapse_pads,
    decode_image,
    decode_images,
    encode_images,
    engine_prompt,
    expand_image_pads,
    image_inputs,
    merge_size,
    mrope_position_ids,
    require_processor,
    sample_media,
    token_id,
    tokens_per_image,
    uses_mrope,
)

__all__ = [
    "IMAGE_PAD", "ImageDecodeError", "MROPE_PROCESSORS", "VIDEO_PAD", "add_multimodal_outputs",
    "collapse_pads", "decode_image", "decode_images", "encode_images", "engine_prompt",
    "expand_image_pads", "image_inputs", "merge_size", "mrope_position_ids", "require_processor",
    "sample_media", "token_id", "tokens_per_image", "uses_mrope",
]
