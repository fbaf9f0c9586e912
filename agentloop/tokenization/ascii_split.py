"""A pre-tokenizer's split pattern run by Python's own ``re``, for the ASCII pieces the word path
takes.

:mod:`agentloop.tokenization.words` cuts a new piece into words with the tokenizer's pattern, and
only pieces of printable ASCII, tabs and line breaks reach it.  On those characters the Unicode
classes of the pattern are plain ranges (``\\p{L}`` is ``A-Za-z``, ``\\p{N}`` is ``0-9``,
``\\p{Lo}`` or ``\\p{M}`` match nothing), so the pattern rewritten with those ranges and compiled
by ``re`` (``re.ASCII``) cuts such a piece as the ``regex`` module does, in ~2.5 µs instead of ~6 µs
for a 50-character user turn on this machine.

:func:`ascii_split` rewrites only what it knows (the Unicode properties in :data:`ASCII_RANGES`,
inside or outside a character class) and refuses anything else (``\\P{..}``, a property it does not
know, a property with no ASCII member outside a class, a class left empty, a set nested in a
class).  The rewrite is then checked: both compiled patterns must cut every text of a fixed sample
the same way, else the ``regex`` version is kept.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

__all__ = ["ASCII_RANGES", "SAMPLE_PARTS", "ascii_split", "translate"]

ASCII_RANGES = {
    "L": "A-Za-z", "Lu": "A-Z", "Ll": "a-z", "Lt": "", "Lm": "", "Lo": "", "M": "", "Mn": "",
    "Mc": "", "Me": "", "N": "0-9", "Nd": "0-9", "Nl": "", "No": "",
}
"""Unicode general categories -> their members among the characters the word path takes."""

_PROPERTY = re.compile(r"\\[pP]\{(\w+)\}")

SAMPLE_PARTS = [
    "what", "What", "IS", " plus", "Step", " ", "  ", "   ", "\n", "\n\n", " \n", "  \n  ", "\t",
    "\r\n", "\r", "'s", "'S", "'ll", "'LL", "'re", "'Ve", "'d", "'M", "'T", "don't", "1", "12",
    "123", "1234", "12345", "3.14", "?", "!", "...", ":", " (#", ")", "-", "_x_", "\"", "{", "}",
    "[1, 2]", "<", ">", "/", "\\", "a", "Z", "x2", "2x", "  #", "~", "`", "@@", " $", "%", "^",
    "aB", "Ab", "ABc", "abC", " /", "/\n", ".\n", "\t\n", " \t ", "'", "''", "'x",
]
"""Pieces of text that split patterns treat specially (runs of spaces before a word or a line break,
digit runs, contractions in both cases, punctuation glued to line breaks): random joins of them are
what a rewrite is checked on (and what ``tests/unit/test_word_encoder.py`` encodes both ways)."""


def translate(pattern: str) -> str | None:
    """``pattern`` with each Unicode property replaced by its ASCII ranges, or None when a part of
    it has no plain rewrite (see the module docstring)."""
    out: list[str] = []
    in_class = False
    members = 0  # where the open class's members start in ``out``
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            prop = _PROPERTY.match(pattern, i)
            if prop is None:
                out.append(pattern[i:i + 2])
                i += 2
                continue
            if prop.group(0)[1] == "P" or prop.group(1) not in ASCII_RANGES:
                return None
            ranges = ASCII_RANGES[prop.group(1)]
            if not in_class and not ranges:
                return None
            if ranges:
                out.append(ranges if in_class else f"[{ranges}]")
            i = prop.end()
            continue
        if c == "[" and in_class:
            return None  # a nested set or a POSIX class ([[:alpha:]]): re reads it otherwise
        if c == "[":
            in_class = True
            out.append(c)
            i += 1
            if pattern.startswith("^", i):
                out.append("^")
                i += 1
            if pattern.startswith("]", i):  # a literal ']' first in a class: not rewritten
                return None
            members = len(out)
            continue
        if c == "]" and in_class:
            if len(out) == members:
                return None  # no member has an ASCII character: an empty class
            in_class = False
        out.append(c)
        i += 1
    return None if in_class else "".join(out)


def _sample(count: int = 400) -> list[str]:
    rng = random.Random(0)
    return [
        "".join(rng.choice(SAMPLE_PARTS) for _ in range(rng.randint(1, 16))) for _ in range(count)
    ]


def ascii_split(pattern: str, unicode_split: Callable[[str], list[str]]) -> Callable[
        [str], list[str]] | None:
    """``findall`` of ``pattern`` rewritten for ``re`` (:func:`translate`), when it compiles and
    cuts the fixed sample exactly as ``unicode_split`` (the ``regex`` module's ``findall`` of
    ``pattern``) does; else None."""
    plain = translate(pattern)
    if plain is None:
        return None
    try:
        split = re.compile(plain, re.ASCII).findall
    except re.error:
        return None
    if any(split(text) != unicode_split(text) for text in _sample()):
        return None
    return split
