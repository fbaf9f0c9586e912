"""Piecewise prompt encoding (agentloop.tokenization.segments) gives exactly the whole-text ids.

Rendered prompts of the four template families and of the tiny model, with tools, several turns and
text around the special tokens, are encoded both ways; the piecewise path is refused for tokenizers
whose added tokens strip their neighbours, and a wrong piece is caught by the start-up check (the
caller still gets the whole-text ids).
"""

from __future__ import annotations

import functools
import logging
import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from agentloop.config import ModelConfig
from agentloop.loops.prompt import apply_chat_template, clear_render_cache
from agentloop.testing.templates import FAMILIES, make_template_tokenizer
from agentloop.testing.tiny_model import ensure_tiny_model
from agentloop.tokenization import segments
from agentloop.tokenization.fast import decode_ids, encode_text, fast_backend
from agentloop.tokenization.loader import load_tokenizer
from agentloop.tokenization.segments import SegmentEncoder, segment_encoder

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}
WORDS = ["what", "is", " 12", "plus", "\n", "  ", "é", "<|", "|>", "tool", "call", "😀", "\t", "x"]


def conversation(rng: random.Random) -> list[dict[str, str]]:
    def text() -> str:
        return "".join(rng.choice(WORDS) + rng.choice(["", " "]) for _ in range(rng.randint(0, 12)))

    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    for _ in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": text()})
        messages.append({"role": "assistant", "content": text()})
    messages.append({"role": "user", "content": text()})
    return messages


@functools.cache
def tokenizers_under_test() -> list[object]:
    tiny = load_tokenizer(ModelConfig.from_root(
        {"actor_rollout_ref": {"model": {"path": str(ensure_tiny_model())}}}))
    return [tiny, *(make_template_tokenizer(name) for name in FAMILIES)]


@pytest.mark.parametrize("index", range(1 + len(FAMILIES)))
def test_piecewise_ids_equal_whole_text_ids(index):
    tok = tokenizers_under_test()[index]
    backend = fast_backend(tok)
    encoder = segment_encoder(backend)
    assert encoder is not None, "these tokenizers' added tokens cut cleanly"
    rng = random.Random(index)
    for _ in range(150):
        messages = conversation(rng)
        tools = [CALCULATOR] if rng.random() < 0.5 else None
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                       add_generation_prompt=True)
        text += rng.choice(["", "<|im_end|>", " <|im_start|>x", "\n\n"])  # around the tokens
        assert encoder.encode(text) == list(backend.encode(text, add_special_tokens=False).ids)
    assert encoder.enabled, "the start-up check found no difference"


def test_render_ids_equal_hf_ids_with_pieces_remembered():
    tok = tokenizers_under_test()[0]
    clear_render_cache()
    rng = random.Random(7)
    for _ in range(100):
        messages = conversation(rng)
        ids = apply_chat_template(tok, messages, tools=[CALCULATOR], add_generation_prompt=True)
        hf = tok.apply_chat_template(messages, tools=[CALCULATOR], tokenize=True,
                                     add_generation_prompt=True, return_dict=False)
        assert ids == list(hf)
        delta = "<|im_end|>\n<|im_start|>tool\n" + messages[-1]["content"] + "<|im_end|>\n"
        assert encode_text(tok, delta) == tok.encode(delta, add_special_tokens=False)


def _toy_backend(**flags: bool) -> Tokenizer:
    vocab = {c: i for i, c in enumerate(["<unk>", "a", "b", " ", "<s>"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="isolated")
    backend.add_special_tokens([AddedToken("<s>", normalized=False, **flags)])
    return backend


def test_tokens_that_strip_their_neighbours_are_encoded_whole():
    assert segment_encoder(_toy_backend()) is not None
    assert segment_encoder(_toy_backend(lstrip=True)) is None
    assert segment_encoder(_toy_backend(rstrip=True)) is None


def test_a_wrong_piece_is_caught_and_the_whole_text_ids_returned(caplog):
    backend = _toy_backend()
    encoder = SegmentEncoder(backend, {"<s>": 4})
    assert encoder.encode("a<s>b") == [1, 4, 2]
    encoder._pieces["a"] = (2,)  # a remembered piece gone wrong
    with caplog.at_level(logging.WARNING, logger=segments.__name__):
        assert encoder.encode("a<s>b") == [1, 4, 2]
    assert not encoder.enabled and "encoded whole" in caplog.text
    assert encoder.encode("a<s>b") == [1, 4, 2]


@pytest.mark.parametrize("index", range(1 + len(FAMILIES)))
def test_backend_decode_equals_hf_decode(index):
    tok = tokenizers_under_test()[index]
    rng = random.Random(index)
    for _ in range(50):
        text = tok.apply_chat_template(conversation(rng), tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        for skip in (False, True):
            assert decode_ids(tok, ids, skip) == tok.decode(ids, skip_special_tokens=skip)


def test_a_tokenizer_with_its_own_decode_keeps_it():
    base = type(tokenizers_under_test()[0])
    own = type("OwnDecode", (base,), {"decode": lambda self, ids, **kw: "mine"})
    tok = tokenizers_under_test()[0]
    tok.__class__ = own
    try:
        assert decode_ids(tok, [5, 6]) == "mine"
    finally:
        tok.__class__ = base
