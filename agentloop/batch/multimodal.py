"""Images (and videos) in rollouts: decoding, placeholder expansion, ``multi_modal_inputs`` and
M-RoPE ids.

:func:`decode_images` turns what a dataset or tool holds into RGB PIL images (raises
:class:`ImageDecodeError` naming the image); :func:`expand_image_pads` expands each image's
placeholder to its token count exactly as the processor renders it; :func:`add_multimodal_outputs`
adds verl 0.9's ``multi_modal_inputs`` column and, for M-RoPE processors, ``position_ids`` of shape
[B, 4, L]. Videos are passed through to the engine, not decoded here.  Spec:
docs/multimodal.md#what-happens.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from agentloop.errors import ConfigError, DatasetError

if TYPE_CHECKING:
    import torch

    from agentloop.batch.protocol import DataProto

MROPE_PROCESSORS = frozenset({"Qwen2VLProcessor", "Qwen2_5_VLProcessor"})
"""Processor classes whose model uses M-RoPE position ids (rows t / h / w) as Qwen2-VL computes
them."""
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"


class ImageDecodeError(DatasetError):
    """An image of a sample or of a tool response could not be decoded."""


def decode_image(image: Any, where: str = "image") -> Any:
    """``image`` as an RGB ``PIL.Image``: a PIL image, encoded bytes, a path, or a
    ``{"bytes"|"path"|"image"}`` dict (the forms verl datasets hold).  Raises
    :class:`ImageDecodeError` saying which image and why."""
    # not a declared dependency (vLLM and transformers' image stacks bring it): image rows only
    from PIL import Image

    try:
        if isinstance(image, Image.Image):
            out = image
        elif isinstance(image, dict):
            if image.get("bytes") is not None:
                return decode_image(image["bytes"], where)
            if image.get("image") is not None:
                return decode_image(image["image"], where)
            if image.get("path"):
                return decode_image(str(image["path"]), where)
            raise ValueError(
                f"a dict image needs 'bytes', 'image' or 'path', got keys {sorted(image)}"
            )
        elif isinstance(image, (bytes, bytearray)):
            out = Image.open(io.BytesIO(bytes(image)))
        elif isinstance(image, (str, Path)):
            text = str(image)
            out = Image.open(text[len("file://"):] if text.startswith("file://") else text)
        else:
            raise ValueError(f"unsupported image type {type(image).__name__}")
        out.load()
        return out if out.mode == "RGB" else out.convert("RGB")
    except Exception as e:  # noqa: BLE001 - PIL raises many kinds; all mean "cannot use this image"
        raise ImageDecodeError(
            f"{where} could not be decoded ({type(e).__name__}: {e}); give a PIL image, "
            f"encoded image bytes "
            "(PNG/JPEG...), a readable file path, or a {'bytes': ...} / {'path': ...} dict"
        ) from e


def decode_images(images: Sequence[Any], where: str = "image") -> list[Any]:
    """:func:`decode_image` over a list; the error names the image's position
    (``image 2 of ...``)."""
    return [decode_image(img, f"{where} {i}") for i, img in enumerate(images)]


def sample_media(sample: dict[str, Any], kind: str = "image") -> list[Any]:
    """The images (``kind="video"``: videos) of a sample's ``multi_modal_data`` cell (a list /
    object array, or one item; key ``image`` or verl's ``images``), else []."""
    mm = sample.get("multi_modal_data")
    if not isinstance(mm, dict):
        return []
    items = mm.get(kind)
    if items is None:
        items = mm.get(kind + "s")
    if items is None:
        return []
    if isinstance(items, (list, tuple)) or (
        isinstance(items, np.ndarray) and items.dtype == object
    ):
        return list(items)
    return [items]


def require_processor(processor: Any, n_images: int, model_hint: str = "") -> None:
    """Raise a :class:`ConfigError` naming the fix when images come but the model has no image
    processor."""
    if n_images and (processor is None or getattr(processor, "image_processor", None) is None):
        raise ConfigError(
            f"the sample has {n_images} image(s) but the model{model_hint} has no "
            f"multimodal processor (a text-only "
            "model, or its processor failed to load: see the worker log): serve a "
            "vision-language model "
            "(actor_rollout_ref.model.path with a preprocessor_config.json, e.g. "
            "agentloop.testing.tiny_vl_model.ensure_tiny_vl_model()), or drop "
            "multi_modal_data from the data"
        )


def _tokenizer(processor: Any) -> Any:
    return getattr(processor, "tokenizer", processor)


def token_id(processor: Any, kind: str) -> int | None:
    """The id of the processor's ``image`` / ``video`` placeholder token, None when it has none."""
    token = getattr(processor, f"{kind}_token", None) or (
        IMAGE_PAD if kind == "image" else VIDEO_PAD
    )
    tid = _tokenizer(processor).convert_tokens_to_ids(token)
    unk = getattr(_tokenizer(processor), "unk_token_id", None)
    return None if tid is None or (unk is not None and tid == unk) else int(tid)


def merge_size(processor: Any) -> int:
    """The spatial merge size of the image processor (patches merged per side into one token)."""
    return int(getattr(processor.image_processor, "merge_size", 1) or 1)


def image_inputs(processor: Any, images: Sequence[Any]) -> dict[str, torch.Tensor]:
    """``pixel_values`` and ``image_grid_thw`` of ``images`` (decoded), as the processor computes
    them."""
    out = processor.image_processor(images=list(images), return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def tokens_per_image(processor: Any, grid_thw: Any) -> list[int]:
    """Placeholder tokens each image takes: ``t * h * w / merge_size**2`` of its grid."""
    merge = merge_size(processor) ** 2
    return [int(np.prod([int(x) for x in g])) // merge for g in grid_thw]


def expand_image_pads(ids: Sequence[int], pad_id: int, counts: Sequence[int]) -> list[int]:
    """``ids`` with the k-th ``pad_id`` repeated ``counts[k]`` times (one pad per image in, as the
    chat template renders them).  Raises :class:`DatasetError` when pads and images do not pair up.
    """
    found = sum(1 for t in ids if t == pad_id)
    if found != len(counts):
        raise DatasetError(
            f"the rendered text has {found} image placeholder(s) but {len(counts)} image(s) "
            f"were given: every "
            "image needs one {'type': 'image'} content part in the messages, in the same order"
        )
    out: list[int] = []
    k = 0
    for t in ids:
        if t == pad_id:
            out.extend([t] * int(counts[k]))
            k += 1
        else:
            out.append(t)
    return out


def encode_images(processor: Any, ids: Sequence[int], images: Sequence[Any]) -> list[int]:
    """Ids of a rendered turn (one pad per image) with every image's pad expanded to its token
    count; what ``processor(text=decode(ids), images=images)["input_ids"]`` gives.  No images:
    ``ids`` unchanged."""
    if not images:
        return list(ids)
    pad = token_id(processor, "image")
    if pad is None:
        raise ConfigError(
            f"processor {type(processor).__name__} has no image token; cannot place images"
        )
    grids = image_inputs(processor, images)["image_grid_thw"].tolist()
    return expand_image_pads(ids, pad, tokens_per_image(processor, grids))


def uses_mrope(processor: Any) -> bool:
    """True for processors of M-RoPE models (:data:`MROPE_PROCESSORS`)."""
    return processor is not None and any(
        c.__name__ in MROPE_PROCESSORS for c in type(processor).__mro__
    )


def _vision_positions(start: int, grid: Sequence[int], merge: int) -> np.ndarray:
    t, h, w = int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge
    tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
    return np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + start


def mrope_position_ids(
    input_ids: Sequence[int], attention_mask: Sequence[int], *, image_token_id: int | None,
    video_token_id: int | None, image_grid_thw: Sequence[Sequence[int]] = (),
    video_grid_thw: Sequence[Sequence[int]] = (), spatial_merge_size: int = 2,
) -> np.ndarray:
    """verl's [4, L] position ids of one padded row: text positions, then Qwen2-VL's t / h / w
    positions.

    Text tokens advance all three rows by one; a run of image (video) tokens takes the next grid and
    places its merged patches at ``start + (t, h, w)``; the text after it starts at
    ``start + max(h, w)`` (Qwen2-VL's ``get_rope_index``).  Padding (mask 0) is 1 in row 0 and 0 in
    rows 1-3, as in verl 0.9.
    """
    ids = np.asarray(input_ids, dtype=np.int64)
    mask = np.asarray(attention_mask).astype(bool)
    valid = ids[mask]
    kinds = np.zeros(len(valid), dtype=np.int64)
    if image_token_id is not None:
        kinds[valid == image_token_id] = 1
    if video_token_id is not None:
        kinds[valid == video_token_id] = 2
    grids = {1: iter(image_grid_thw), 2: iter(video_grid_thw)}
    chunks, pos, i = [], 0, 0
    while i < len(valid):
        j = i
        while j < len(valid) and kinds[j] == kinds[i]:
            j += 1
        if kinds[i] == 0:
            chunks.append(np.tile(np.arange(j - i) + pos, (3, 1)))
            pos += j - i
        else:
            grid = next(grids[int(kinds[i])], None)
            if grid is None:
                raise DatasetError(
                    f"row has more {'image' if kinds[i] == 1 else 'video'} "
                    f"placeholder runs than "
                    "grids in multi_modal_inputs; the prompt and its images "
                    "do not pair up"
                )
            block = _vision_positions(pos, grid, spatial_merge_size)
            if block.shape[1] != j - i:
                raise DatasetError(
                    f"a placeholder run of {j - i} tokens does not match its "
                    f"grid {list(grid)} "
                    f"({block.shape[1]} tokens): were the image pads "
                    f"expanded by the processor?"
                )
            chunks.append(block)
            pos += max(int(grid[1]), int(grid[2])) // spatial_merge_size
        i = j
    out = np.zeros((4, len(ids)), dtype=np.int64)
    out[0] = 1
    out[0, mask] = np.arange(int(mask.sum()))
    if chunks:
        out[1:, mask] = np.concatenate(chunks, axis=1)
    return out


def _row_images(cell: Any) -> list[Any]:
    if not isinstance(cell, dict):
        return []
    images = cell.get("image", cell.get("images"))
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple, np.ndarray)) else [images]


def add_multimodal_outputs(batch: DataProto, processor: Any) -> DataProto:
    """Add ``multi_modal_inputs`` (object column) and, for M-RoPE processors, [B, 4, L]
    ``position_ids``.

    A no-op without a processor.  Rows are taken as padded by
    :func:`agentloop.batch.postprocess.postprocess` (``input_ids`` / ``attention_mask``); images
    from ``non_tensor_batch["multi_modal_data"]``.
    """
    import torch  # heavy: only for rows with images

    if processor is None or getattr(processor, "image_processor", None) is None:
        return batch
    cells = batch.non_tensor_batch.get("multi_modal_data")
    n = len(batch)
    inputs: list[dict[str, Any]] = []
    for r in range(n):
        images = _row_images(cells[r]) if cells is not None else []
        inputs.append(image_inputs(processor, decode_images(images)) if images else {})
    batch.non_tensor_batch["multi_modal_inputs"] = np.empty(n, dtype=object)
    for r, value in enumerate(inputs):
        batch.non_tensor_batch["multi_modal_inputs"][r] = value
    if not uses_mrope(processor) or batch.batch is None:
        return batch
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    image_id, video_id, merge = (
        token_id(processor, "image"), token_id(processor, "video"), merge_size(processor),
    )
    rows = [
        mrope_position_ids(
            ids[r].tolist(), mask[r].tolist(), image_token_id=image_id, video_token_id=video_id,
            image_grid_thw=inputs[r].get("image_grid_thw", torch.zeros(0, 3)).tolist(),
            spatial_merge_size=merge,
        )
        for r in range(n)
    ]
    position = (
        torch.from_numpy(np.stack(rows))
        if rows
        else torch.zeros((0, 4, ids.shape[1]), dtype=torch.long)
    )
    batch.batch["position_ids"] = position.to(torch.long)
    return batch


def engine_prompt(
    prompt_ids: Sequence[int], image_data: Sequence[Any] | None, video_data: Sequence[Any] | None,
    model_config: Any,
) -> Any:
    """vLLM's ``TokensPrompt`` for a request: images decoded (:func:`decode_images`) as
    ``multi_modal_data["image"]``, videos passed through as ``multi_modal_data["video"]``.  Media
    for a text-only model raise a :class:`ConfigError` naming the fix, before the engine sees the
    request.

    The engine expands every placeholder itself (vLLM replaces each ``<|image_pad|>`` by the image's
    token count), so each run of expanded pads (:func:`expand_image_pads`) is sent as one pad, as
    verl does; the tokens the model sees are the same."""
    from vllm.inputs import TokensPrompt  # optional dependency: vLLM is an extra

    prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_ids)}
    if not image_data and not video_data:
        return TokensPrompt(**prompt)  # type: ignore[typeddict-item]
    if not getattr(model_config, "is_multimodal_model", True):
        raise ConfigError(
            f"the request has {len(image_data or [])} image(s) and {len(video_data or [])} "
            f"video(s) but the served "
            f"model {getattr(model_config, 'model', '')!r} is text-only: serve a "
            f"vision-language model "
            "(actor_rollout_ref.model.path, e.g. "
            "agentloop.testing.tiny_vl_model.ensure_tiny_vl_model()) or "
            "drop multi_modal_data from the data / tool responses"
        )
    if video_data and _video_limit(model_config) == 0:
        raise ConfigError(
            f"the request has {len(video_data)} video(s) but the engine takes none "
            f"(limit_mm_per_prompt video 0, "
            "set where torchvision is missing: transformers builds Qwen2-VL's video "
            "processor only with it); install "
            "a torchvision build matching torch, or drop video_data (docs/multimodal.md)"
        )
    hf = getattr(model_config, "hf_config", None)
    pads = {
        t
        for t in (getattr(hf, "image_token_id", None), getattr(hf, "video_token_id", None))
        if t is not None
    }
    prompt["prompt_token_ids"] = collapse_pads(prompt["prompt_token_ids"], pads)
    media: dict[str, Any] = {}
    if image_data:
        media["image"] = decode_images(list(image_data), "image")
    if video_data:
        media["video"] = list(video_data)
    prompt["multi_modal_data"] = media
    return TokensPrompt(**prompt)  # type: ignore[typeddict-item]


def _video_limit(model_config: Any) -> int | None:
    """vLLM's videos-per-prompt limit of the served model, None when unknown."""
    mm = getattr(model_config, "multimodal_config", None)
    try:
        return int(mm.get_limit_per_prompt("video")) if mm is not None else None
    except Exception:  # noqa: BLE001 - another vLLM version: let the engine decide
        return None


def collapse_pads(ids: Sequence[int], pad_ids: set[int]) -> list[int]:
    """``ids`` with every run of one placeholder id (``pad_ids``) cut to a single token (the inverse
    of :func:`expand_image_pads`)."""
    return [t for i, t in enumerate(ids) if t not in pad_ids or i == 0 or ids[i - 1] != t]
