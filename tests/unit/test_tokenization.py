"""Incremental encoding of tool / user turns equals a full chat-template render, token for token."""

from __future__ import annotations

import random

import pytest

from agentloop.testing import FakeTokenizer
from agentloop.tokenization import (
    TemplateMismatchError,
    check_incremental,
    encode_new_turns,
    turn_separator,
)

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "calc",
                                           "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from transformers import AutoTokenizer

    from agentloop.testing.tiny_model import ensure_tiny_model

    return AutoTokenizer.from_pretrained(str(ensure_tiny_model()))


def random_conversation(rng: random.Random) -> list[dict]:
    msgs: list[dict] = []
    if rng.random() < 0.5:
        msgs.append(
            {
                "role": "system",
                "content": rng.choice(["Be brief.", "You are a calculator.\nUse tools."]),
            }
        )
    msgs.append(
        {"role": "user", "content": f"What is {rng.randint(0, 999)} + {rng.randint(0, 999)}?"}
    )
    for _ in range(rng.randint(1, 3)):
        n_calls = rng.randint(0, 2)
        calls = [
            {
                "type": "function",
                "function": {
                    "name": "calculator",
                    "arguments": {"expression": f"{rng.randint(0, 99)} * 3"},
                },
            }
            for _ in range(n_calls)
        ]
        msgs.append({"role": "assistant", "content": rng.choice(["", "Let me check.", "Sure\n\n"]),
                     **({"tool_calls": calls} if calls else {})})
        if calls:
            msgs += [{"role": "tool", "content": str(rng.randint(-50, 5000))} for _ in calls]
        else:
            msgs.append({"role": "user", "content": rng.choice(["thanks", "again?", "  spaced  "])})
    if rng.random() < 0.5:
        msgs.append({"role": "assistant", "content": "The answer is 42."})
    return msgs


def test_chatml_separator_is_the_newline_after_im_end(tiny_tokenizer):
    assert turn_separator(tiny_tokenizer) == "\n"
    ids = encode_new_turns(tiny_tokenizer, [{"role": "tool", "content": "5"}])
    assert (
        tiny_tokenizer.decode(ids)
        == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_incremental_equals_full_render_on_random_conversations(tiny_tokenizer):
    rng = random.Random(0)
    for _ in range(60):
        msgs = random_conversation(rng)
        check_incremental(tiny_tokenizer, msgs, tools=TOOLS if rng.random() < 0.7 else None)


def test_checker_works_on_the_fake_tokenizer_and_catches_a_missing_separator():
    tok = FakeTokenizer()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}]
    check_incremental(tok, msgs)

    class NoSeparator(FakeTokenizer):
        """A buggy incremental encoder would drop the '\\n' after <|im_end|>; the checker must
        notice."""

    import agentloop.tokenization.incremental as inc

    original = inc.turn_separator
    inc.turn_separator = lambda tokenizer, eos_token=None: ""  # simulate the classic bug
    try:
        with pytest.raises(TemplateMismatchError, match="differ"):
            check_incremental(NoSeparator(), msgs)
    finally:
        inc.turn_separator = original
