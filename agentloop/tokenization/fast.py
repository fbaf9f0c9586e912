"""Encoding text with a fast tokenizer's Rust backend directly, when that gives exactly HF's ids.

``tokenizer.encode(text, add_special_tokens=False)`` on a fast HF tokenizer ends in the Rust
backend's ``encode``; around it HF spends ~20-40 µs of Python per call (argument handling, a batch
of one, a ``BatchEncoding``).  Agent loops encode a prompt per sample and a delta per tool turn, so
they call the backend directly whenever it is safe, and encode rendered text piece by piece between
added tokens, remembering the pieces (:mod:`agentloop.tokenization.segments`).
``tests/unit/test_tokenization_families.py`` checks the ids are identical.
"""

from __future__ import annotations

from typing import Any

from agentloop.tokenization.segments import segment_encoder


def fast_backend(tokenizer: Any) -> Any | None:
    """The Rust ``tokenizers.Tokenizer`` behind a fast HF tokenizer, when encoding with it directly
    gives exactly what ``tokenizer(text, add_special_tokens=False)`` gives: no truncation or padding
    set on it (HF resets both per call; a direct call would apply leftovers) and no special-token
    splitting.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        backend is None
        or not hasattr(backend, "encode")
        or getattr(tokenizer, "split_special_tokens", False)
    ):
        return None
    if (
        getattr(backend, "truncation", None) is not None
        or getattr(backend, "padding", None) is not None
    ):
        return None
    return backend


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens=False)`` as a list, through the backend when
    safe."""
    backend = fast_backend(tokenizer)
    if backend is not None:
        return encode_with_backend(backend, text)
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_with_backend(backend: Any, text: str) -> list[int]:
    """``backend.encode(text, add_special_tokens=False).ids`` as a list, piece by piece with the
    pieces remembered where that is exact (:mod:`agentloop.tokenization.segments`)."""
    pieces = segment_encoder(backend)
    if pieces is not None:
        return pieces.encode(text)
    return list(backend.encode(text, add_special_tokens=False).ids)


_PLAIN_DECODE: dict[type, bool] = {}


def _decodes_plainly(tokenizer: Any) -> bool:
    """Whether ``tokenizer.decode(ids, skip_special_tokens=s)`` is exactly its Rust backend's
    ``decode``: transformers' own ``decode`` / ``_decode`` (not overridden) and no clean-up of
    tokenization spaces."""
    cls = type(tokenizer)
    plain = _PLAIN_DECODE.get(cls)
    if plain is None:
        try:
            # heavy (~1 s); loaded by the tokenizer's owner anyway
            from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast
        except ImportError:  # pragma: no cover - transformers is a dependency
            plain = False
        else:
            plain = (
                getattr(cls, "decode", None) is PreTrainedTokenizerBase.decode
                and getattr(cls, "_decode", None) is PreTrainedTokenizerFast._decode
            )
        _PLAIN_DECODE[cls] = plain
    return plain and not getattr(tokenizer, "clean_up_tokenization_spaces", True)


def decode_ids(tokenizer: Any, ids: list[int], skip_special_tokens: bool = False) -> str:
    """``tokenizer.decode(ids, skip_special_tokens=...)``, through the Rust backend when that is
    exactly the same (~10 µs less per call)."""
    backend = fast_backend(tokenizer) if _decodes_plainly(tokenizer) else None
    if backend is not None:
        return str(backend.decode(list(ids), skip_special_tokens=skip_special_tokens))
    return str(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
