"""Tokenizer and processor loading from the model config slice (verl's ``actor_rollout_ref.model``).

Keys honoured, with verl's meaning:

* ``tokenizer_path`` — load the tokenizer (and processor) from here instead of ``path``;
* ``custom_chat_template`` — a Jinja chat template string that replaces the tokenizer's (and the
  processor's) ``chat_template``;
* ``trust_remote_code`` — passed to ``from_pretrained``.

Neutral module: workers, the gateway and the CLI all load through here, so they agree on the
template.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agentloop.config import ModelConfig
from agentloop.servers.vllm_plugin import install

logger = logging.getLogger(__name__)

# Files whose presence marks a multimodal processor (transformers' PROCESSOR_NAME,
# IMAGE_PROCESSOR_NAME /
# FEATURE_EXTRACTOR_NAME and VIDEO_PROCESSOR_NAME); a text model's directory has none of them.
_PROCESSOR_FILES = (
    "processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json",
)


def model_config(model_cfg: ModelConfig | Mapping[str, Any] | Any) -> ModelConfig:
    """``model_cfg`` as a :class:`ModelConfig`: the ``actor_rollout_ref.model`` mapping (absent keys
    take the YAML's values) or a ModelConfig already.

    Raises:
        ConfigError: a value is mistyped.
    """
    if isinstance(model_cfg, ModelConfig):
        return model_cfg
    return ModelConfig.from_root({"actor_rollout_ref": {"model": model_cfg}})


def tokenizer_source(model_cfg: ModelConfig | Mapping[str, Any] | Any) -> str:
    """Where the tokenizer comes from: ``tokenizer_path`` when set, else ``path`` (``~``
    expanded)."""
    model = model_config(model_cfg)
    return model.local_tokenizer_path or model.local_path


def load_tokenizer(model_cfg: ModelConfig | Mapping[str, Any] | Any) -> Any:
    """The HF tokenizer for ``model_cfg`` (a :class:`ModelConfig` or the model mapping): from
    ``tokenizer_path`` (else ``path``), with ``custom_chat_template`` installed as its
    ``chat_template`` when set."""
    from transformers import AutoTokenizer  # heavy (~1 s): config and dataset checks run before it

    model = model_config(model_cfg)
    tokenizer = AutoTokenizer.from_pretrained(
        tokenizer_source(model), trust_remote_code=model.trust_remote_code
    )
    template = model.custom_chat_template
    if template is not None:
        tokenizer.chat_template = str(template)
    return tokenizer


def is_multimodal_dir(path: str | Path) -> bool:
    """True when a local model/tokenizer directory ships a processor config (image, video or
    audio)."""
    p = Path(path)
    return any((p / name).is_file() for name in _PROCESSOR_FILES)


def load_processor(
    model_cfg: ModelConfig | Mapping[str, Any] | Any, tokenizer: Any | None = None
) -> Any | None:
    """The HF processor of a multimodal model, else ``None``.

    Cheap for text models: a local directory without a processor config file is answered without
    importing anything.  Never raises: a processor that fails to load is logged and ``None``
    returned (text-only generation still works).  The processor gets the tokenizer's chat template
    when it has none (as verl does), and ``custom_chat_template`` when set.

    Args:
        model_cfg: a :class:`ModelConfig` or the model config slice.
        tokenizer: the already-loaded tokenizer, whose chat template a template-less processor
        takes.
    """
    model = model_config(model_cfg)
    src = tokenizer_source(model)
    if os.path.isdir(src) and not is_multimodal_dir(src):
        return None
    try:
        from transformers import AutoProcessor, PreTrainedTokenizerBase  # heavy, as above

        # Qwen2-VL without torchvision: an image-only processor (a no-op with torchvision)
        install()
        processor = AutoProcessor.from_pretrained(src, trust_remote_code=model.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - a text model with a stray config must still run
        logger.warning(
            "no processor loaded from %s (%s: %s); continuing text-only", src, type(e).__name__, e
        )
        return None
    if isinstance(processor, PreTrainedTokenizerBase):  # AutoProcessor fell back to the tokenizer
        return None
    template = model.custom_chat_template
    if template is not None:
        processor.chat_template = str(template)
        inner = getattr(processor, "tokenizer", None)
        if inner is not None:
            inner.chat_template = str(template)
    elif not getattr(processor, "chat_template", None):
        fallback = getattr(tokenizer, "chat_template", None) or getattr(
            getattr(processor, "tokenizer", None), "chat_template", None
        )
        if fallback:
            processor.chat_template = fallback
    return processor
