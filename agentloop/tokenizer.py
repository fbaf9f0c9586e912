"""The documented import path of :mod:`agentloop.tokenization.loader` (re-exports only)."""

from agentloop.tokenization.loader import (  # noqa: F401
    is_multimodal_dir,
    load_processor,
    load_tokenizer,
    model_config,
    tokenizer_source,
)

__all__ = [
    "is_multimodal_dir", "load_processor", "load_tokenizer", "model_config", "tokenizer_source",
]
