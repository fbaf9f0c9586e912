"""Encoding rendered chat prompts piece by piece, remembering the pieces.

A fast tokenizer cuts its input at its added tokens (``<|im_start|>``, ``<|im_end|>``, ...) before
anything else, and normalises, pre-tokenises and runs its model on each piece between them on its
own.  So when every added token matches verbatim (``normalized=False``) and eats nothing around it
(no ``lstrip`` / ``rstrip`` / ``single_word``), the ids of a text are the ids of its pieces, joined.
Rendered prompts repeat most of their pieces (the system prompt and tool schemas of every sample,
the role headers, earlier turns), so :class:`SegmentEncoder` encodes each distinct piece once: a
191-token tool-agent prompt took ~234 µs to encode whole on this machine, its system piece being
nearly all of it.
A new piece is encoded word by word where that is exact, the words remembered too
(:mod:`agentloop.tokenization.words`).

Exactness is checked, not assumed: the first :data:`VERIFY_FIRST` encodes of each encoder are also
encoded whole, and one difference turns the piecewise path off for that tokenizer for good (a
warning says so). ``tests/unit/test_segment_encoder.py`` compares the two on the template families.
"""

from __future__ import annotations

import logging
import re
import threading
import weakref
from collections import OrderedDict
from typing import Any

from agentloop.tokenization.words import per_backend, word_encoder

logger = logging.getLogger(__name__)

PIECE_CACHE_SIZE = 4096
"""Distinct pieces remembered per tokenizer backend."""
VERIFY_FIRST = 64
"""Encodes per backend checked against a whole-text encode before the check stops."""

_encoders: weakref.WeakKeyDictionary[Any, SegmentEncoder | None] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class SegmentEncoder:
    """Encodes text as its pieces between added tokens (see the module docstring).

    Args:
        backend: a ``tokenizers.Tokenizer`` whose added tokens all cut cleanly
            (:func:`segment_encoder` checks this).
        added: added token text -> id.
    """

    def __init__(self, backend: Any, added: dict[str, int]) -> None:
        self.backend = backend
        self.added = added
        # leftmost match, longest first among tokens starting at the same place (as the tokenizer)
        pattern = "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True))
        self._split = re.compile(f"({pattern})").split
        self._pieces: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._checks_left = VERIFY_FIRST
        self.enabled = True
        self.words = word_encoder(backend)
        """New pieces word by word, where exact (None: whole)."""

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` (no special tokens added), as ``backend.encode`` gives them."""
        if not self.enabled:
            return list(self.backend.encode(text, add_special_tokens=False).ids)
        ids: list[int] = []
        pieces = self._pieces
        for i, piece in enumerate(self._split(text)):
            if i % 2:  # an added token
                ids.append(self.added[piece])
                continue
            if not piece:
                continue
            known = pieces.get(piece)
            if known is None:
                known = self._encode_piece(piece)
                with _lock:
                    pieces[piece] = known
                    if len(pieces) > PIECE_CACHE_SIZE:
                        pieces.popitem(last=False)
            ids.extend(known)
        if self._checks_left > 0:
            return self._checked(text, ids)
        return ids

    def _encode_piece(self, piece: str) -> tuple[int, ...]:
        """A piece seen for the first time: word by word where that is exact
        (:mod:`agentloop.tokenization.words`), else by the backend."""
        if self.words is not None:
            ids = self.words.encode(piece)
            if ids is not None:
                return tuple(ids)
        return tuple(self.backend.encode(piece, add_special_tokens=False).ids)

    def _checked(self, text: str, ids: list[int]) -> list[int]:
        """The whole-text ids; a difference from ``ids`` turns the piecewise path off."""
        self._checks_left -= 1
        whole = list(self.backend.encode(text, add_special_tokens=False).ids)
        if whole != ids:
            self.enabled = False
            logger.warning(
                "encoding a prompt piece by piece gave other ids than encoding it whole "
                "(%d vs %d ids); this tokenizer's prompts are encoded whole from now on",
                len(ids), len(whole),
            )
        return whole


def _clean_cuts(backend: Any) -> dict[str, int] | None:
    """Added token text -> id when every added token cuts the input cleanly, else None."""
    try:
        decoder = backend.get_added_tokens_decoder()
    except AttributeError:
        return None
    if getattr(backend, "encode_special_tokens", False):
        return None  # special tokens are not cut then
    added: dict[str, int] = {}
    for token_id, token in decoder.items():
        content = getattr(token, "content", None)
        if (
            not content
            or getattr(token, "normalized", True)
            or getattr(token, "lstrip", True)
            or getattr(token, "rstrip", True)
            or getattr(token, "single_word", True)
        ):
            return None
        added[content] = int(token_id)
    return added or None


def segment_encoder(backend: Any) -> SegmentEncoder | None:
    """The piecewise encoder of a ``tokenizers.Tokenizer`` (one per backend), or None when its
    added tokens do not all cut cleanly (then encode whole)."""
    return per_backend(_encoders, backend, _build)


def _build(backend: Any) -> SegmentEncoder | None:
    added = _clean_cuts(backend)
    return SegmentEncoder(backend, added) if added else None
