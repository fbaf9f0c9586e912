"""The split patterns rewritten for Python's re (agentloop.tokenization.ascii_split) cut ASCII
pieces exactly as the regex module cuts them with the tokenizer's own pattern; what has no plain
rewrite keeps the regex module."""

from __future__ import annotations

import random
import string

import pytest
import regex

from agentloop.testing.templates import FAMILIES, make_template_tokenizer
from agentloop.tokenization.ascii_split import ascii_split, translate
from agentloop.tokenization.fast import fast_backend
from agentloop.tokenization.words import split_pattern, word_encoder

SAFE = string.ascii_letters + string.digits + string.punctuation + " \t\n\r"


@pytest.mark.parametrize("family", FAMILIES)
def test_families_cut_ascii_text_as_the_regex_module_does(family):
    backend = fast_backend(make_template_tokenizer(family))
    pattern = split_pattern(backend)
    words = word_encoder(backend)
    assert words is not None
    # the shipped split is the rewrite (Python's re), not the regex module's
    assert type(words._split.__self__).__module__ == "re"
    unicode_split = regex.compile(pattern).findall
    rng = random.Random(family)
    for _ in range(3000):
        text = "".join(rng.choice(SAFE) for _ in range(rng.randint(0, 48)))
        assert words._split(text) == unicode_split(text), repr(text)


@pytest.mark.parametrize(
    ("pattern", "rewritten"),
    [
        (r"\p{L}+|\p{N}{1,3}", "[A-Za-z]+|[0-9]{1,3}"),
        (r"[^\r\n\p{L}\p{N}]?\p{L}+", r"[^\r\nA-Za-z0-9]?[A-Za-z]+"),
        (r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}]+", "[A-Z]*[a-z]+"),
        (r"\s+(?!\S)|\[x\]", r"\s+(?!\S)|\[x\]"),  # escaped brackets are not classes
    ],
)
def test_translate_rewrites_unicode_classes_as_ascii_ranges(pattern, rewritten):
    assert translate(pattern) == rewritten


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        (r"\P{L}+", "a negated property"),
        (r"\p{Greek}+", "a property it does not know"),
        (r"\p{Lo}+", "no ASCII member outside a class"),
        (r"[\p{Lo}\p{M}]+", "a class left empty"),
        (r"[]a]", "a literal ] first in a class"),
        (r"[a-z", "an unclosed class"),
        (r"[[:alpha:]]+", "a POSIX class (a nested set to re)"),
    ],
)
def test_translate_refuses_what_has_no_plain_rewrite(pattern, why):
    assert translate(pattern) is None, why


def test_a_rewrite_that_cuts_differently_is_not_used():
    pattern = r"\p{L}+|\s+"
    assert ascii_split(pattern, regex.compile(pattern).findall) is not None
    # a "tokenizer pattern" whose cut the rewrite does not reproduce: the check on the sample
    # refuses it
    assert ascii_split(pattern, regex.compile(r"\p{L}|\s+").findall) is None
