"""Encoding a new piece of prompt word by word, remembering the words.

A byte-level BPE tokenizer of the Qwen2 / Llama 3 / o200k kind cuts each piece of text between its
added tokens into pre-tokens ("words") with one regular expression, then runs its model on each word
on its own. So the ids of a piece are the ids of its words, joined, and a word seen before need not
be encoded again. A new 50-character user turn took ~22 µs through the Rust backend on this machine,
~17 µs of it the pre-tokenizer's regular expression; word by word it takes ~7 µs (Python's
``regex`` module runs the same expression in ~6 µs; the pattern rewritten for ``re`` on ASCII, in
~2.5 µs: :mod:`agentloop.tokenization.ascii_split`). Every first turn of every sample renders such
a piece, so this is most of what a batch of new prompts costs before its requests leave (issue 33).

Used only where both ways are sure to give the same ids:

* the tokenizer: no BPE dropout; no normalizer, or a Unicode normal form (which leaves ASCII as
  it is); its pre-tokenizer one regex ``Split`` (``Isolated``, not inverted) followed by a
  ``ByteLevel`` step that adds no prefix space and runs no regex of its own; a pattern with no
  anchors, no back-references and no lookaround but ``(?!\\S)`` (then a word encoded alone is cut
  as it is in its text: see ``tests/unit/test_word_encoder.py``);
* the piece: printable ASCII, tabs and line breaks, where Python's ``regex`` and the tokenizer's
  Oniguruma agree on ``\\s``, ``\\p{L}`` and ``\\p{N}``. Other pieces are encoded whole, as before.

The words must cover the piece, and :class:`~agentloop.tokenization.segments.SegmentEncoder`'s
start-up check (its first encodes compared with whole-text ones) covers this path too.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import weakref
from collections.abc import Callable
from typing import Any

from agentloop.tokenization.ascii_split import ascii_split

logger = logging.getLogger(__name__)

WORD_CACHE_SIZE = 65536
"""Distinct words remembered per tokenizer backend (the cache starts again when full)."""

_ASCII_SAFE_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})
_OUTSIDE_SAFE_ASCII = re.compile(r"[^\t\n\r\x20-\x7e]").search
_UNPLAIN = re.compile(r"\(\?[=!<]|\\[bBAZzGK1-9]|\$")

_encoders: weakref.WeakKeyDictionary[Any, WordEncoder | None] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class WordEncoder:
    """Encodes safe pieces word by word (see the module docstring).

    Args:
        backend: the ``tokenizers.Tokenizer``.
        split: the pre-tokenizer's cut as a function (a compiled pattern's ``findall``).
    """

    def __init__(self, backend: Any, split: Callable[[str], list[str]]) -> None:
        self.backend = backend
        self._split = split
        self._words: dict[str, tuple[int, ...]] = {}

    def encode(self, piece: str) -> list[int] | None:
        """The ids of ``piece`` (no added tokens in it), or None when it is not a safe piece."""
        if _OUTSIDE_SAFE_ASCII(piece) is not None:
            return None
        words = self._split(piece)
        if "".join(words) != piece:  # a character no alternative matched: let the backend decide
            return None
        known = self._words
        ids: list[int] = []
        for word in words:
            got = known.get(word)
            if got is None:
                got = tuple(self.backend.encode(word, add_special_tokens=False).ids)
                if len(known) >= WORD_CACHE_SIZE:
                    known.clear()
                known[word] = got
            ids += got
        return ids


def _state(component: Any) -> dict[str, Any] | None:
    """A tokenizers component's JSON spec (None when it has none we can read)."""
    try:
        return json.loads(component.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return None


def _plain(pattern: str) -> bool:
    """Whether ``pattern`` has no anchors, back-references or lookaround besides ``(?!\\S)``."""
    rest = pattern.replace(r"(?!\S)", "")
    return _UNPLAIN.search(rest) is None and "^" not in rest.replace("[^", "[")


def split_pattern(backend: Any) -> str | None:
    """The regular expression that cuts ``backend``'s text into words, when word-by-word encoding
    is exact for it (see the module docstring); else None."""
    if getattr(getattr(backend, "model", None), "dropout", None):
        return None  # BPE dropout: a word's ids differ call to call
    normalizer = getattr(backend, "normalizer", None)
    if normalizer is not None:
        spec = _state(normalizer)
        if spec is None or spec.get("type") not in _ASCII_SAFE_NORMALIZERS:
            return None
    pre = getattr(backend, "pre_tokenizer", None)
    spec = _state(pre) if pre is not None else None
    if spec is None:
        return None
    steps = (spec.get("pretokenizers") if spec.get("type") == "Sequence" else [spec]) or []
    if len(steps) != 2:
        return None
    split, byte_level = steps
    pattern = (split.get("pattern") or {}).get("Regex")
    if (
        split.get("type") != "Split" or split.get("behavior") != "Isolated"
        or split.get("invert") or not isinstance(pattern, str)
        or byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex", True)
        or byte_level.get("add_prefix_space", True)
    ):
        return None
    return pattern if _plain(pattern) else None


def per_backend(cache: weakref.WeakKeyDictionary[Any, Any], backend: Any,
                build: Callable[[Any], Any]) -> Any:
    """``build(backend)``, made once per backend and remembered in ``cache`` (weakly, with the
    backend); None, unremembered, for a backend that takes no weak reference."""
    try:
        return cache[backend]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable
        return None
    value = build(backend)
    with _lock:
        cache[backend] = value
    return value


def word_encoder(backend: Any) -> WordEncoder | None:
    """The word-by-word encoder of a ``tokenizers.Tokenizer`` (one per backend), or None where it
    would not be exact, or the ``regex`` module cannot compile the tokenizer's pattern."""
    return per_backend(_encoders, backend, _build)


def _build(backend: Any) -> WordEncoder | None:
    pattern = split_pattern(backend)
    if pattern is None:
        return None
    try:
        import regex  # transformers' own dependency; Unicode classes \p{L}, \p{N}
    except ImportError:  # pragma: no cover - installed with transformers
        return None
    try:
        split = regex.compile(pattern).findall
    except regex.error as e:
        logger.debug("pre-tokenizer pattern not compiled by regex (%s): encode whole", e)
        return None
    # the safe pieces are ASCII: the same cut by Python's re where it rewrites exactly (faster)
    return WordEncoder(backend, ascii_split(pattern, split) or split)
