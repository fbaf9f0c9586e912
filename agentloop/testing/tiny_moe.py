"""Build a tiny Qwen3-MoE checkpoint locally (no model hub), for routing-replay (R3) tests.

:func:`ensure_tiny_moe_model` writes, in a few seconds and deterministically, a directory that
``transformers`` (``Qwen3MoeForCausalLM``) and vLLM load like any Qwen3-MoE checkpoint: the tiny
text model's tokenizer and chat template (``agentloop/assets/tiny-qwen2``) and random fp32 weights
of :data:`MOE_SHAPE` (2 layers, :data:`NUM_EXPERTS` experts, top-:data:`TOP_K`).  The router
weights are drawn with a large scale (:data:`ROUTER_STD`) so each token's top-k experts win by a
clear margin: vLLM's and transformers' fp32 kernels then pick the same experts.  Its text means
nothing.  Cached under ``$AGENTLOOP_CACHE_DIR/tiny-qwen3-moe`` like the text model.  Spec:
docs/porting-from-verl.md#routing-replay-r3.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from agentloop.testing.tiny_model import (
    DEFAULT_NAME,
    IM_END,
    MARKER,
    PAD_TOKEN,
    SHIPPED_DIR,
    build_in_place,
    content_hash,
    tiny_model_path,
)

MOE_BUILDER_VERSION = "2"  # 2: head_dim 32 (vLLM CPU attention has no head_dim 16)
MOE_NAME = "tiny-qwen3-moe"
NUM_EXPERTS = 8
TOP_K = 2
NUM_LAYERS = 2
ROUTER_STD = 1.0
MOE_SHAPE: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 64,
    "num_hidden_layers": NUM_LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "num_experts": NUM_EXPERTS, "num_experts_per_tok": TOP_K,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "max_position_embeddings": 4096, "tie_word_embeddings": True,
}
"""The model's shape (``Qwen3MoeConfig`` keywords); vocabulary and special ids come from the
tokenizer."""
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tiny_moe_model_path() -> Path:
    """Where :func:`ensure_tiny_moe_model` puts the model by default
    (``$AGENTLOOP_CACHE_DIR/tiny-qwen3-moe``)."""
    return tiny_model_path(MOE_NAME)


def init_moe_model(vocab_size: int, pad: int, eos: int, seed: int = 0) -> Any:
    """A randomly initialised fp32 ``Qwen3MoeForCausalLM`` of :data:`MOE_SHAPE`.

    Args:
        vocab_size: the tokenizer's size (rounded up to a multiple of 64 for the embedding).
        pad: the pad (and bos) token id.
        eos: the end-of-turn token id.
        seed: torch's seed for the weights.

    Returns:
        The model in eval mode, router weights drawn with std :data:`ROUTER_STD`.
    """
    # heavy (torch, transformers): only when building
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **MOE_SHAPE, vocab_size=(vocab_size + 63) // 64 * 64, bos_token_id=pad,
        eos_token_id=eos, pad_token_id=pad, dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight
            gate.copy_(torch.randn(gate.shape, generator=generator) * ROUTER_STD)
    model.eval()
    return model


def build_moe_into(out_dir: Path) -> None:
    """Write the tokenizer files, weights, generation config and the marker into ``out_dir``.

    Raises:
        FileNotFoundError: the shipped tiny model's tokenizer is missing.
    """
    # heavy (transformers): only when building
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    shipped = SHIPPED_DIR / DEFAULT_NAME
    for name in _TOKENIZER_FILES:
        shutil.copyfile(shipped / name, out_dir / name)
    vocab = json.loads((shipped / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    size = max([*vocab["model"]["vocab"].values(), *ids.values()]) + 1
    pad, eos = ids[PAD_TOKEN], ids[IM_END]
    model = init_moe_model(size, pad, eos)
    model.save_pretrained(str(out_dir))
    GenerationConfig(bos_token_id=pad, eos_token_id=eos, pad_token_id=pad).save_pretrained(
        str(out_dir)
    )
    for file in out_dir.iterdir():
        file.chmod(0o644)
    marker = {
        "builder_version": f"moe-{MOE_BUILDER_VERSION}", "content_sha256": content_hash(out_dir),
        "vocab": size,
    }
    (out_dir / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")


def _is_current(path: Path) -> bool:
    try:
        marker = json.loads((path / MARKER).read_text())
        return (marker.get("builder_version") == f"moe-{MOE_BUILDER_VERSION}"
                and marker.get("content_sha256") == content_hash(path))
    except (OSError, ValueError):
        return False


def ensure_tiny_moe_model(path: str | Path | None = None, *, force: bool = False) -> Path:
    """Build the tiny Qwen3-MoE model at ``path`` (default :func:`tiny_moe_model_path`) unless it
    is current.

    Idempotent and safe to call from parallel processes (file lock, build into a temporary
    directory, atomic rename).

    Args:
        path: the model directory (default :func:`tiny_moe_model_path`).
        force: rebuild even if a current model is there.

    Returns:
        The model directory.

    Raises:
        FileExistsError: ``path`` is a non-empty directory that holds no tiny model.
    """
    target = Path(path).expanduser().absolute() if path is not None else tiny_moe_model_path()
    return build_in_place(target, build_moe_into, _is_current, force=force)
