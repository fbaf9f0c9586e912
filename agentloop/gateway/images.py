"""Images in gateway requests: checking image parts, decoding them, and their exact token ids.

Every dialect hands the service chat ``image_url`` parts whose URL is a base64 data URL
(``data:image/png;base64,...``).  :func:`image_url_part` checks a part's form when a request is
parsed; :class:`ImageEncoder` decodes the images of the messages a request adds to a session's trie,
refuses bad ones (not base64, not an image, over ``rollout.gateway.max_image_bytes``, a text-only
model) with an :class:`ImagePartError` naming the part (``messages.3.content.1``), and expands each
image's placeholder to its token count exactly as the model's processor renders it.  The gateway
never fetches a URL.  Spec: docs/gateway.md#images.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from collections.abc import Iterator, Sequence
from typing import Any

from agentloop.batch.multimodal import (
    decode_image,
    expand_image_pads,
    image_inputs,
    token_id,
    tokens_per_image,
)
from agentloop.config.build import read_value
from agentloop.errors import AgentLoopError

DEFAULT_MAX_IMAGE_BYTES: int = read_value(
    None, "actor_rollout_ref.rollout.gateway.max_image_bytes")
"""The YAML's ``gateway.max_image_bytes`` (5 MiB): :class:`ImageEncoder`'s default."""
MAX_IMAGE_PIXELS = 8192 * 8192
"""Largest image (width x height) decoded; a bigger one is refused before its pixels are read."""
IMAGE_PART_TYPES = ("image_url", "input_image", "image")
"""Part types that carry an image in any dialect (only ``image_url`` reaches the service)."""
_DATA_URL = re.compile(r"data:(?P<mime>[^;,]*)(?P<params>(?:;[^;,]*)*),(?P<data>.*)", re.DOTALL)
_FORM = "{'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,...'}}"
_INLINE = "send the image inline as a base64 data URL (data:image/png;base64,...)"


class ImagePartError(AgentLoopError, ValueError):
    """An image part the gateway refuses (a 400); ``param`` names it (``messages.3.content.1``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _label(param: str) -> str:
    """``messages.3.content.1`` -> ``messages[3].content[1]`` (how error messages name a part)."""
    return re.sub(r"\.(\d+)", r"[\1]", param)


def _refuse(param: str, why: str) -> ImagePartError:
    return ImagePartError(f"{_label(param)}: {why}", param)


def data_url(media_type: str, data: str) -> str:
    """``data:<media_type>;base64,<data>``: the form every dialect hands its images on in."""
    return f"data:{media_type};base64,{data}"


def image_url_part(part: dict[str, Any], param: str) -> dict[str, Any]:
    """A chat ``image_url`` part checked for form, as ``{"type": "image_url", "image_url": {"url":
    <data URL>}}`` (``detail`` dropped: the processor decides the resolution).

    Raises:
        ImagePartError: no URL string, or a URL that is not a base64 ``data:image/...`` URL.
    """
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise ImagePartError(f"{_label(param)} must be {_FORM}", param)
    _payload_text(url, param)
    return {"type": "image_url", "image_url": {"url": url}}


def _payload_text(url: str, param: str) -> str:
    """The base64 text of a ``data:image/...;base64,`` URL; raises :class:`ImagePartError` else."""
    if "://" in url[:64] or url[:5].lower() == "file:":
        raise _refuse(param, f"the gateway does not fetch image URLs ({url[:40]!r}); {_INLINE}")
    match = _DATA_URL.match(url)
    if match is None:
        raise _refuse(param, f"the image URL is not a data URL ({url[:40]!r}); {_INLINE}")
    mime = match["mime"].strip().lower()
    if not mime.startswith("image/"):
        raise _refuse(param, f"the data URL's media type must be image/*, got {mime!r}")
    if "base64" not in (p.strip() for p in match["params"].lower().split(";")):
        raise _refuse(param, f"the data URL must be base64-encoded (data:{mime};base64,...)")
    return match["data"]


class ImageEncoder:
    """Decodes and places the images of new messages for one served model.

    Args:
        processor: the model's HF processor; None, or one without an image processor, is a text-only
            model, which refuses every image part.
        max_image_bytes: the largest decoded image (``rollout.gateway.max_image_bytes``).
        model_name: the served model's name, for the text-only refusal.
    """

    def __init__(self, processor: Any = None, max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
                 model_name: str = "") -> None:
        has_images = getattr(processor, "image_processor", None) is not None
        self.processor = processor if has_images else None
        self.max_image_bytes = int(max_image_bytes)
        self.model_name = model_name
        self._pad = token_id(processor, "image") if has_images else None

    def expand(self, ids: list[int], messages: Sequence[dict[str, Any]],
               offset: int = 0) -> list[int]:
        """``ids`` (the template's rendering of ``messages``, one placeholder per image) with each
        image's placeholder expanded to its token count, as ``processor(text=, images=)`` does.

        Args:
            ids: the rendered ids of ``messages``.
            messages: the messages rendered; ``messages[k]`` is request message ``offset + k``.
            offset: the index of ``messages[0]`` in the request (to name a part).

        Raises:
            ImagePartError: a bad or too large image, a model that takes no images, or placeholders
                in the text that do not pair up with the images.
        """
        parts = list(_image_parts(messages, offset))
        if self.processor is None:
            if parts:
                name = f" {self.model_name!r}" if self.model_name else ""
                raise _refuse(parts[0][0], f"the served model{name} takes no images (a text-only"
                                           " model); send text only, or serve a vision-language"
                                           " model")
            return ids
        images = [self._decode(self._payload(part, param), param) for param, part in parts]
        found = sum(1 for t in ids if t == self._pad)
        if found != len(images):
            where = parts[0][0] if parts else "messages"
            raise _refuse(where, f"the rendered messages hold {found} image placeholder token(s)"
                                 f" for {len(images)} image(s); the text must not contain the"
                                 " placeholder token itself")
        if not images:
            return ids
        grids = image_inputs(self.processor, images)["image_grid_thw"].tolist()
        pad = self._pad
        if pad is None:  # text-only models refuse image parts before this point
            raise ImagePartError("the served model takes no images", "messages")
        return expand_image_pads(ids, pad, tokens_per_image(self.processor, grids))

    def sources(self, messages: Sequence[dict[str, Any]], offset: int = 0) -> list[bytes]:
        """The encoded image files of ``messages``' image parts, in order (what the engine and the
        row get); call it after :meth:`expand` accepted the parts."""
        return [self._payload(part, param) for param, part in _image_parts(messages, offset)]

    def _payload(self, part: dict[str, Any], param: str) -> bytes:
        text = _payload_text(image_url_part(part, param)["image_url"]["url"], param)
        approx = len(text) * 3 // 4
        if approx > self.max_image_bytes + 2:
            raise _refuse(param, f"the image has about {approx} bytes, over the limit of "
                                 f"{self.max_image_bytes} (rollout.gateway.max_image_bytes)")
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError) as e:
            raise _refuse(param, f"the data URL's payload is not valid base64 ({e})") from None
        if len(raw) > self.max_image_bytes:
            raise _refuse(param, f"the image has {len(raw)} bytes, over the limit of "
                                 f"{self.max_image_bytes} (rollout.gateway.max_image_bytes)")
        return raw

    def _decode(self, raw: bytes, param: str) -> Any:
        """``raw`` as an RGB PIL image; raises :class:`ImagePartError` when it is not one."""
        # PIL is not a declared dependency (vLLM and transformers bring it): image requests only
        from PIL import Image

        try:
            image = Image.open(io.BytesIO(raw))
            width, height = image.size
        except Exception as e:  # noqa: BLE001 - PIL raises many kinds: all mean "not an image"
            raise _refuse(param, f"the data is not an image ({type(e).__name__})") from None
        if width * height > MAX_IMAGE_PIXELS:
            raise _refuse(param, f"the image is {width}x{height} pixels, over the limit of "
                                 f"{MAX_IMAGE_PIXELS} pixels")
        try:
            return decode_image(image, _label(param))
        except Exception as e:  # noqa: BLE001 - a corrupt file fails only when its pixels are read
            raise _refuse(param, f"the image could not be decoded ({type(e).__name__})") from None


def _image_parts(messages: Sequence[dict[str, Any]],
                 offset: int) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(param, part)`` of every image part of ``messages``, in rendering order."""
    for k, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                yield f"messages.{offset + k}.content.{j}", part
