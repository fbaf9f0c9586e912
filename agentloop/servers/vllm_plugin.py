"""vLLM general plugin: Qwen2-VL image rollouts where torchvision is not installed.

:func:`install` (idempotent; returns True when the patches are in place, False where torchvision is
installed and nothing is done) answers imports of transformers' torchvision-backed Qwen2-VL image
processor with its PIL twin (``Qwen2VLImageProcessorPil``) and makes
``Qwen2VLProcessor.from_pretrained`` (so ``AutoProcessor``) assemble an image-only processor: images
work, a video raises ``RuntimeError`` (videos need torchvision). :func:`engine_arg_defaults` gives
such engines ``limit_mm_per_prompt: {video: 0}``. :func:`register` is the ``vllm.general_plugins``
entry point (``agentloop_qwen2_vl``: vLLM runs it in each of its processes; leave it out of
``VLLM_PLUGINS`` to disable it); :func:`agentloop.tokenization.loader.load_processor` calls
:func:`install` too.

Spec (why, what is patched): docs/multimodal.md#without-torchvision-cpu-machines.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from types import ModuleType
from typing import Any, TypedDict

from agentloop.batch.multimodal import IMAGE_PAD, VIDEO_PAD

_TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
_PROCESSOR_MODULE = "transformers.models.qwen2_vl.processing_qwen2_vl"
_QWEN2_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")
_installed = False


def torchvision_available() -> bool:
    return importlib.util.find_spec("torchvision") is not None


class _PilImageProcessingModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the torchvision image-processing module of Qwen2-VL from its PIL twin, and patches the
    processor module when something imports it (nothing is imported before that: vLLM loads this
    plugin in every process, text-only ones too)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name == _TORCHVISION_MODULE:
            return importlib.util.spec_from_loader(name, self)
        if name == _PROCESSOR_MODULE:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchAfterLoading(spec.loader)
            return spec
        return None

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        pil = importlib.import_module(_PIL_MODULE)
        module.__dict__.update({k: v for k, v in vars(pil).items() if not k.startswith("__")})
        module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # type: ignore[attr-defined]


class _PatchAfterLoading(importlib.abc.Loader):
    """Runs the real loader of Qwen2-VL's processor module, then :func:`_patch_processor`."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _patch_processor(module)


def _patch_processor(module: ModuleType) -> None:
    cls = module.Qwen2VLProcessor

    def from_pretrained(
        cls: Any, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any
    ) -> Any:
        return image_only_qwen2_vl_processor(cls, str(pretrained_model_name_or_path), **kwargs)

    cls.from_pretrained = classmethod(from_pretrained)


class _NoVideoKwargs(TypedDict, total=False):
    """No video processing options (there is no video processor)."""


class VideosNeedTorchvision(dict):  # type: ignore[type-arg]  # a dict so the processor's repr / to_json work
    """Stands in for Qwen2-VL's video processor where torchvision is missing: calling it raises."""

    valid_kwargs = _NoVideoKwargs
    model_input_names: list[str] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "this Qwen2-VL processor has no video processor: transformers builds it only "
            "with torchvision, which "
            "is not installed; install a torchvision build matching torch to pass videos "
            "(images work without it)"
        )


def image_only_qwen2_vl_processor(cls: Any, path: str, **kwargs: Any) -> Any:
    """A ``cls`` (``Qwen2VLProcessor``) made of the checkpoint's tokenizer, PIL image processor and
    chat template; its video processor is :class:`VideosNeedTorchvision`."""
    # heavy: the plugin loads in every vLLM process
    from transformers import AutoImageProcessor, AutoTokenizer

    opts = {
        k: kwargs[k] for k in ("trust_remote_code", "revision", "local_files_only") if k in kwargs
    }
    tokenizer = AutoTokenizer.from_pretrained(path, **opts)
    processor = cls.__new__(cls)  # __init__ insists on a video processor
    processor.tokenizer = tokenizer
    processor.image_processor = AutoImageProcessor.from_pretrained(path, **opts)
    processor.video_processor = VideosNeedTorchvision()
    processor.chat_template = getattr(tokenizer, "chat_template", None)
    processor.image_token, processor.video_token = IMAGE_PAD, VIDEO_PAD
    processor.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    processor.video_token_id = tokenizer.convert_tokens_to_ids(VIDEO_PAD)
    return processor


def install() -> bool:
    """Apply both patches when torchvision is missing (idempotent).  True when they are in place."""
    global _installed
    if _installed:
        return True
    if torchvision_available():
        return False
    sys.meta_path.insert(0, _PilImageProcessingModule())
    if _PROCESSOR_MODULE in sys.modules:  # imported before the plugin: patch it now
        _patch_processor(sys.modules[_PROCESSOR_MODULE])
    _installed = True
    return True


def engine_arg_defaults(model_path: str) -> dict[str, Any]:
    """Engine arguments a Qwen2-VL-family checkpoint needs where torchvision is missing: no video
    inputs (``limit_mm_per_prompt: {video: 0}``), else vLLM's start-up profiling calls the missing
    video processor. Empty for every other model, and wherever torchvision is installed."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError):
        return {}
    if model_type not in _QWEN2_VL_TYPES or torchvision_available():
        return {}
    return {"limit_mm_per_prompt": {"video": 0}}


def register() -> None:
    """The ``vllm.general_plugins`` entry point."""
    install()
