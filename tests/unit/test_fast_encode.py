"""Tool-turn encoding is cheap and still exact: the Rust backend gives HF's ids, the separator is
remembered."""

from __future__ import annotations

import copy
import random

import pytest

import agentloop.tokenization.incremental as inc
from agentloop.testing.templates import FAMILIES, STOP_TOKENS, make_template_tokenizer
from agentloop.tokenization import turn_separator
from agentloop.tokenization.fast import encode_text, fast_backend

PIECES = [
    "<tool_response>", "</tool_response>", "\n", "  ", "12 + 30", "é", "🙂", '{"a": [1, 2]}',
    "Tab\there", "<|im_start|>", "<|im_end|>", "<|eot_id|>", "<|return|>", "<|call|>",
    "not<|special", "ÿ",
]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_backend_encoding_gives_the_tokenizers_own_ids(family):
    tok = make_template_tokenizer(family)
    assert fast_backend(tok) is not None
    rng = random.Random(family)
    for _ in range(200):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12)))
        assert encode_text(tok, text) == list(tok.encode(text, add_special_tokens=False)), text


def test_truncation_left_on_the_backend_does_not_leak_into_a_delta():
    tok = copy.deepcopy(make_template_tokenizer("chatml_hermes"))
    text = "<tool_response>\n" + "12 + 30 " * 40 + "</tool_response>"
    expected = list(tok.encode(text, add_special_tokens=False))
    tok._tokenizer.enable_truncation(max_length=8)
    try:
        assert fast_backend(tok) is None
        assert encode_text(tok, text) == expected
    finally:
        tok._tokenizer.no_truncation()
    assert len(expected) > 8


def test_the_separator_is_found_once_per_tokenizer_template_and_stop_token(monkeypatch):
    found: list[str] = []
    real = inc.find_separator
    monkeypatch.setattr(
        inc, "find_separator", lambda tokenizer, eos: found.append(eos) or real(tokenizer, eos)
    )
    # a copy: the shared one may be cached by other tests
    tok = copy.deepcopy(make_template_tokenizer("harmony"))
    for _ in range(5):
        for stop in STOP_TOKENS["harmony"]:
            assert turn_separator(tok, stop) == ""
    assert found == list(STOP_TOKENS["harmony"])

    # another tokenizer (a copy: shared ones stay)
    chatml = copy.deepcopy(make_template_tokenizer("chatml_hermes"))
    assert turn_separator(chatml) == "\n" and len(found) == 3
    # the template changed: looked up again
    chatml.chat_template = make_template_tokenizer("qwen3").chat_template
    assert turn_separator(chatml) == "\n" and len(found) == 4
    chatml.chat_template = make_template_tokenizer("llama3_json").chat_template
    assert turn_separator(chatml, "<|eot_id|>") == "" and len(found) == 5
