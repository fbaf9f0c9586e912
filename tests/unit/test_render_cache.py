"""Prompt renders are remembered per tokenizer: a GRPO batch renders each distinct prompt once,
exactly."""

from __future__ import annotations

import os
from typing import Any

import pytest

import agentloop
from agentloop.loops.prompt import apply_chat_template
from agentloop.testing.fake_tokenizer import FakeTokenizer


class CountingTokenizer(FakeTokenizer):
    def __init__(self, chat_template: str | None = None) -> None:
        self.renders = 0
        self.chat_template = chat_template

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        self.renders += 1
        return super().apply_chat_template(messages, **kwargs)


def chat(text: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]


def test_each_distinct_prompt_is_rendered_once_and_the_ids_are_the_renders():
    tok = CountingTokenizer()
    prompts = [chat(f"question {i // 8}") for i in range(64)]  # 8 prompts x rollout.n = 8
    got = [apply_chat_template(tok, m, add_generation_prompt=True) for m in prompts]
    assert tok.renders == 8
    assert got == [
        FakeTokenizer().apply_chat_template(m, add_generation_prompt=True) for m in prompts
    ]


def test_a_returned_list_is_the_callers_own():
    tok = CountingTokenizer()
    first = apply_chat_template(tok, chat("q"))
    first.append(99)
    assert apply_chat_template(tok, chat("q"))[-1] != 99


def test_anything_the_render_depends_on_is_part_of_the_key():
    tok = CountingTokenizer("template A")
    apply_chat_template(tok, chat("q"))
    apply_chat_template(tok, chat("q"), add_generation_prompt=True)  # other keyword arguments
    apply_chat_template(tok, chat("q"), tools=[{"type": "function", "function": {"name": "calc"}}])
    apply_chat_template(tok, chat("q "))  # other content
    tok.chat_template = "template B"  # the template changed
    apply_chat_template(tok, chat("q"))
    assert tok.renders == 5
    other = CountingTokenizer("template B")  # another tokenizer never shares renders
    apply_chat_template(other, chat("q"))
    assert other.renders == 1


def test_templates_that_read_the_clock_and_non_json_content_are_rendered_every_time():
    dated = CountingTokenizer("Today is {{ strftime_now('%d %b %Y') }}")
    for _ in range(3):
        apply_chat_template(dated, chat("q"))
    assert dated.renders == 3

    class Opaque:
        def __str__(self) -> str:
            return "opaque"

    tok = CountingTokenizer()
    for _ in range(3):
        apply_chat_template(tok, [{"role": "user", "content": Opaque()}])
    assert tok.renders == 3


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        os.path.join(os.path.dirname(agentloop.__file__), "assets", "tiny-qwen2")
    )


def test_a_token_added_to_the_vocabulary_is_used_by_later_renders(hf_tokenizer):
    messages = chat("say <|newtok|> twice: <|newtok|>")
    before = apply_chat_template(hf_tokenizer, messages, add_generation_prompt=True)
    hf_tokenizer.add_tokens(["<|newtok|>"], special_tokens=True)
    after = apply_chat_template(hf_tokenizer, messages, add_generation_prompt=True)
    new_id = hf_tokenizer.convert_tokens_to_ids("<|newtok|>")
    assert new_id not in before and after.count(new_id) == 2
    assert after == hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_the_least_recently_used_render_is_forgotten_first_and_size_zero_turns_the_cache_off(
    monkeypatch,
):
    from agentloop.loops import prompt

    monkeypatch.setattr(prompt, "RENDER_CACHE_SIZE", 2)
    tok = CountingTokenizer()
    for text in ["a", "b", "a", "c"]:  # "b" is the least recently used when "c" arrives
        apply_chat_template(tok, chat(text))
    assert tok.renders == 3
    apply_chat_template(tok, chat("a"))
    assert tok.renders == 3
    apply_chat_template(tok, chat("b"))
    assert tok.renders == 4

    monkeypatch.setattr(prompt, "RENDER_CACHE_SIZE", 0)
    off = CountingTokenizer()
    for _ in range(3):
        apply_chat_template(off, chat("a"))
    assert off.renders == 3


def test_values_python_finds_equal_but_jinja_renders_apart_are_different_keys():
    tok = CountingTokenizer()
    apply_chat_template(tok, chat("q"), enable_thinking=True)
    apply_chat_template(tok, chat("q"), enable_thinking=1)
    apply_chat_template(tok, [{"role": "user", "content": 1}])
    apply_chat_template(tok, [{"role": "user", "content": 1.0}])
    apply_chat_template(tok, [{"role": "user", "content": True}])
    assert tok.renders == 5


def test_long_and_structured_messages_are_remembered_too():
    tok = CountingTokenizer()
    long = chat("x" * 50_000)
    parts = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this?"}]}
    ]
    for _ in range(3):
        assert apply_chat_template(tok, long) == FakeTokenizer().apply_chat_template(long)
        apply_chat_template(tok, parts, tools=[{"type": "function", "function": {"name": "calc"}}])
    assert tok.renders == 2


def test_renders_from_many_threads_at_once_stay_exact(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from agentloop.loops import prompt

    # constant eviction while threads read and write
    monkeypatch.setattr(prompt, "RENDER_CACHE_SIZE", 4)
    tok = CountingTokenizer()
    texts = [f"q{i % 12}" for i in range(2000)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda t: apply_chat_template(tok, chat(t)), texts))
    assert got == [FakeTokenizer().apply_chat_template(chat(t)) for t in texts]


def test_a_render_the_same_as_the_one_before_is_checked_as_strictly_as_the_key():
    # the copies of a GRPO prompt render one after another: the comparison with the last render
    # must tell apart whatever the cache key tells apart
    tok = CountingTokenizer("template A")
    messages = chat("q")
    apply_chat_template(tok, messages)
    apply_chat_template(tok, chat("q"))  # equal messages: not rendered again
    assert tok.renders == 1
    apply_chat_template(tok, [{"content": m["content"], "role": m["role"]} for m in messages])
    assert tok.renders == 2  # the keys in another order (a template may iterate them)
    apply_chat_template(tok, messages)  # remembered from the first call
    tok.chat_template = "template B"
    apply_chat_template(tok, messages)
    assert tok.renders == 3  # the template changed in between


def test_a_conversation_changed_after_its_render_is_rendered_anew():
    # a multi-turn loop keeps its message list and appends to it, or edits a message in place
    tok = CountingTokenizer()
    messages = chat("q")
    first = apply_chat_template(tok, messages)
    messages[1]["content"] = "another question"
    edited = apply_chat_template(tok, messages)
    messages.append({"role": "assistant", "content": "an answer"})
    longer = apply_chat_template(tok, messages)
    assert tok.renders == 3
    assert edited != first and longer != edited
    assert longer == FakeTokenizer().apply_chat_template(messages)
