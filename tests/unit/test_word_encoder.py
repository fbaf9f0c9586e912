"""Word-by-word encoding of new prompt pieces (agentloop.tokenization.words) gives exactly the
backend's ids.

Random ASCII text built from the cases where a regex split depends on what follows
(``ascii_split.SAMPLE_PARTS``: runs of spaces before a word or a line break, digit runs,
contractions in both cases, punctuation glued to line breaks, tabs, carriage returns) is encoded
both ways with the tiny model's tokenizer and the template families' (Qwen2, Llama 3 and o200k
split patterns); text outside the safe ASCII set goes to the backend; tokenizers whose
pre-tokenizer or normalizer could cut or change a word differently alone get no word encoder.
"""

from __future__ import annotations

import functools
import random

import pytest
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

from agentloop.config import ModelConfig
from agentloop.loops.prompt import apply_chat_template, clear_render_cache
from agentloop.testing.templates import FAMILIES, make_template_tokenizer
from agentloop.testing.tiny_model import ensure_tiny_model
from agentloop.tokenization import segments
from agentloop.tokenization.ascii_split import SAMPLE_PARTS
from agentloop.tokenization.fast import fast_backend
from agentloop.tokenization.loader import load_tokenizer
from agentloop.tokenization.words import WordEncoder, split_pattern, word_encoder


def texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return [
        "".join(rng.choice(SAMPLE_PARTS) for _ in range(rng.randint(1, 24))) for _ in range(count)
    ]


@functools.cache
def backends() -> list[object]:
    tiny = load_tokenizer(ModelConfig.from_root(
        {"actor_rollout_ref": {"model": {"path": str(ensure_tiny_model())}}}))
    return [fast_backend(tok) for tok in (tiny, *(make_template_tokenizer(n) for n in FAMILIES))]


@pytest.mark.parametrize("index", range(1 + len(FAMILIES)))
def test_word_ids_equal_backend_ids(index):
    backend = backends()[index]
    words = word_encoder(backend)
    assert words is not None, "these byte-level BPE tokenizers must get the word path"
    for text in texts(index, 1500):
        expected = list(backend.encode(text, add_special_tokens=False).ids)
        assert words.encode(text) == expected, repr(text)
        assert words.encode(text) == expected, repr(text)  # the words remembered


def test_text_outside_safe_ascii_goes_to_the_backend():
    backend = backends()[0]
    words = word_encoder(backend)
    for text in ["héllo wörld", "tab\vvertical", "\x1cfile sep", "emoji 😀", "\x00", "del\x7f"]:
        assert words.encode(text) is None, repr(text)
    encoder = segments.segment_encoder(backend)
    assert encoder is not None and encoder.words is words
    for text in ["héllo  wörld\n", "ok then", "x\x1c y"]:
        assert encoder.encode(text) == list(backend.encode(text, add_special_tokens=False).ids)


def test_words_that_do_not_cover_the_piece_are_refused():
    backend = backends()[0]
    skipping = WordEncoder(backend, lambda text: text.split())  # loses the spaces
    assert skipping.encode("two words") is None


def test_rendered_prompts_equal_hf_ids_with_the_word_path():
    tok = load_tokenizer(ModelConfig.from_root(
        {"actor_rollout_ref": {"model": {"path": str(ensure_tiny_model())}}}))
    clear_render_cache()
    for i, text in enumerate(texts(99, 200)):
        messages = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": f"{i}: {text}"}]
        ours = apply_chat_template(tok, messages, add_generation_prompt=True)
        hf = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
        assert ours == list(hf)


def _byte_level_bpe(pre: object, normalizer: object = None) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    return tokenizer


QWEN2 = FAMILIES["chatml_hermes"].pretokenize_regex


@pytest.mark.parametrize(
    ("pre", "normalizer", "why"),
    [
        (pre_tokenizers.Metaspace(), None, "SentencePiece-style spaces depend on the word's place"),
        (pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False),
        ]), None, "a prefix space would be added to every word"),
        (pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"(?<=\d)\d|\s+|\w+"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]), None, "a lookbehind sees text a lone word does not have"),
        (pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"^\s+|\w+|\s+"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]), None, "an anchor"),
        (pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2), behavior="merged_with_previous"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]), None, "words merged with their neighbour"),
        (pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]), normalizers.Lowercase(), "a normalizer that changes ASCII"),
        (pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), None,
         "the byte-level step's own split (not claimed)"),
    ],
)
def test_tokenizers_that_could_cut_a_word_differently_get_no_word_encoder(pre, normalizer, why):
    backend = _byte_level_bpe(pre, normalizer)
    assert split_pattern(backend) is None, why
    assert word_encoder(backend) is None, why


def test_bpe_dropout_gets_no_word_encoder():
    backend = _byte_level_bpe(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]))
    backend.model = models.BPE(dropout=0.1)
    assert split_pattern(backend) is None


def test_the_qwen2_shape_is_accepted():
    backend = _byte_level_bpe(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]), normalizers.NFC())
    assert split_pattern(backend) == QWEN2
