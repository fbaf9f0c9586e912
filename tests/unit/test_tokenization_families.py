"""check_incremental over four chat-template families (ChatML/hermes, Qwen3, Llama 3 JSON, harmony).

For each family: many random conversations that the family can encode exactly pass the checker; the
cases a template cannot encode exactly (it re-renders earlier turns) are caught with the reason; and
deliberately broken incremental encoders are caught.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

import agentloop.tokenization.incremental as inc
from agentloop.testing.templates import FAMILIES, STOP_TOKENS, make_template_tokenizer
from agentloop.tokenization import (
    TemplateMismatchError,
    check_incremental,
    encode_new_turns,
    turn_separator,
)

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12 * 7"}},
            "required": ["expression"],
        },
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up in a dictionary.",
        "parameters": {
            "type": "object",
            "required": ["word"],
            "properties": {
                "word": {"type": "string"},
                "lang": {"type": "string", "enum": ["en", "de"], "description": "Language"},
                "limit": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
        },
    },
}
TOOLS = [CALCULATOR, LOOKUP]
N_CONVERSATIONS = 60
# Families whose history keeps a finished answer as sampled, so a user turn may follow it exactly.
USER_FOLLOW_UPS = {"chatml_hermes": True, "qwen3": False, "llama3_json": True, "harmony": True}


def call(name: str, args: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": args}}


def random_call(rng: random.Random) -> dict[str, Any]:
    if rng.random() < 0.7:
        args: Any = {"expression": f"{rng.randint(0, 999)} * {rng.randint(0, 99)}"}
        name = "calculator"
    else:
        name, args = (
            "lookup",
            {"word": rng.choice(["apple", "Haus", "naïve"]), "lang": rng.choice(["en", "de"])},
        )
    return call(name, json.dumps(args) if rng.random() < 0.3 else args)


def random_result(rng: random.Random) -> str:
    n = rng.randint(-50, 5000)
    return rng.choice([str(n), json.dumps({"result": n}), f"{n}\nchecked", "error: not a number"])


def assistant(
    rng: random.Random, family: str, calls: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """An assistant message as a parser would return it from a sample of ``family``'s policy."""
    msg: dict[str, Any] = {"role": "assistant"}
    if family == "llama3_json":  # trimmed text; a JSON tool call carries no text
        msg["content"] = (
            "" if calls else rng.choice(["The answer is 42.", "Sure, it is 7.", "Done:\n\n12"])
        )
    elif family == "harmony":
        msg["content"] = "" if calls else rng.choice(["The answer is 42.", "It is 7.\n", "12"])
        if rng.random() < 0.6:
            msg["thinking"] = rng.choice(["Need the calculator.", "User asks 3*4.\nCompute it."])
    else:
        texts = (
            ["", "Let me check.", "Sure\n\n"]
            if calls
            else ["The answer is 42.", "Sure\n\n", "Done."]
        )
        msg["content"] = rng.choice(texts)
    # a thinking policy; reasoning may only be empty on the last turn (fixed below)
    if family == "qwen3":
        msg["reasoning_content"] = rng.choice(
            ["", "I need the tool.", "\nFirst 3 * 4.\nThen add.\n"]
        )
        if rng.random() < 0.2:  # reasoning inline in the content, as a raw parse would leave it
            # as the template writes it
            reasoning = msg.pop("reasoning_content").strip("\n") or "Hm."
            msg["content"] = f"<think>\n{reasoning}\n</think>\n\n{msg['content']}"
    if calls:
        msg["tool_calls"] = calls
    return msg


def make_exact(messages: list[dict[str, Any]], family: str) -> None:
    """Drop what ``family``'s template would not keep in the history (see
    agentloop.tokenization)."""
    last = len(messages) - 1
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        later_final = any(
            x["role"] == "assistant" and not x.get("tool_calls") for x in messages[k + 1 :]
        )
        if family == "harmony" and (
            (m.get("tool_calls") and later_final) or (not m.get("tool_calls") and k < last)
        ):
            m.pop("thinking", None)
        if (
            family == "qwen3"
            and k < last
            and not m.get("reasoning_content")
            and "<think>" not in m["content"]
        ):
            m["reasoning_content"] = "Keep going."


def random_conversation(
    rng: random.Random, family: str
) -> tuple[list[dict[str, Any]], Any, dict[str, Any]]:
    tools = TOOLS if rng.random() < 0.8 else None
    msgs: list[dict[str, Any]] = []
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
    max_calls = min(2, FAMILIES[family].max_calls_per_turn)
    for _ in range(rng.randint(1, 3)):
        if tools and (not USER_FOLLOW_UPS[family] or rng.random() < 0.7):
            calls = [random_call(rng) for _ in range(rng.randint(1, max_calls))]
            msgs.append(assistant(rng, family, calls))
            msgs += [{"role": "tool", "content": random_result(rng)} for _ in calls]
        elif USER_FOLLOW_UPS[family]:
            msgs.append(assistant(rng, family))
            msgs.append(
                {
                    "role": "user",
                    "content": rng.choice(["thanks", "again?", "  spaced  ", "Und jetzt?"]),
                }
            )
    if rng.random() < 0.6 or msgs[-1]["role"] == "user" and len(msgs) <= 2:
        msgs.append(assistant(rng, family))
    make_exact(msgs, family)
    kwargs: dict[str, Any] = {}
    if family == "llama3_json":
        kwargs["tools_in_user_message"] = rng.random() < 0.6
    if family == "harmony":
        kwargs["reasoning_effort"] = rng.choice(["low", "medium", "high"])
    return msgs, tools, kwargs


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_random_conversations_are_exact(family):
    tok = make_template_tokenizer(family)
    rng = random.Random(f"families-{family}")
    n_tool_rounds = n_follow_ups = 0
    for _ in range(N_CONVERSATIONS):
        msgs, tools, kwargs = random_conversation(rng, family)
        ids = check_incremental(
            tok, msgs, tools, end_of_turn=STOP_TOKENS[family], chat_template_kwargs=kwargs
        )
        assert ids
        roles = [m["role"] for m in msgs]
        n_tool_rounds += roles.count("tool") > 0
        n_follow_ups += roles.count("user") > 1
    assert n_tool_rounds > N_CONVERSATIONS // 2
    assert (n_follow_ups > 5) == USER_FOLLOW_UPS[family]


@pytest.mark.parametrize(
    "family, separator",
    [("chatml_hermes", "\n"), ("qwen3", "\n"), ("llama3_json", ""), ("harmony", "")],
)
def test_separator_after_each_stop_token(family, separator):
    tok = make_template_tokenizer(family)
    for stop in STOP_TOKENS[family]:
        assert turn_separator(tok, stop) == separator
    assert tok.eos_token == STOP_TOKENS[family][0]


TOOL_TURN = {
    "chatml_hermes": "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n",  # noqa: E501
    "qwen3": "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n",  # noqa: E501
    "llama3_json": "<|start_header_id|>ipython<|end_header_id|>\n\n12<|eot_id|><|start_header_id|>assistant"  # noqa: E501
    "<|end_header_id|>\n\n",
    "harmony": "<|start|>functions.calculator "
    "to=assistant<|channel|>commentary<|message|>12<|end|><|start|>assistant",
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tool_turn_delta(family):
    tok = make_template_tokenizer(family)
    previous = {
        "role": "assistant", "content": "",
        "tool_calls": [call("calculator", {"expression": "3 * 4"})],
        "reasoning_content": "Use the tool.",
    }
    ids = encode_new_turns(tok, [{"role": "tool", "content": "12"}], tools=TOOLS, previous=previous,
                           end_of_turn=STOP_TOKENS[family][-1])
    assert tok.decode(ids) == TOOL_TURN[family]


def test_template_tokenizers_are_cached_and_carry_single_token_specials():
    for name, fam in FAMILIES.items():
        tok = make_template_tokenizer(name)
        assert tok is make_template_tokenizer(name)
        assert tok.chat_template == fam.chat_template
        for token in fam.special_tokens + fam.added_tokens:
            assert len(tok.encode(token, add_special_tokens=False)) == 1, (name, token)
    with pytest.raises(KeyError, match="unknown template family"):
        make_template_tokenizer("mistral")


# --- what cannot be exact is caught, with the reason
# -------------------------------------------------------

Q = {"role": "user", "content": "What is 3 * 4?"}
CALC_CALL = call("calculator", {"expression": "3 * 4"})
RESULT = {"role": "tool", "content": "12"}


def test_qwen3_user_turn_after_reasoning_is_caught():
    tok = make_template_tokenizer("qwen3")
    answer = {"role": "assistant", "content": "It is 12.", "reasoning_content": "3 * 4 = 12."}
    msgs = [
        Q, answer, {"role": "user", "content": "Doubled?"}, {"role": "assistant", "content": "24."},
    ]
    with pytest.raises(TemplateMismatchError, match=r"reasoning.*after the last user query"):
        check_incremental(tok, msgs)
    with pytest.raises(TemplateMismatchError, match=r"re-renders earlier turns.*<think>"):
        encode_new_turns(tok, [msgs[2]], previous=answer)


def test_qwen3_empty_reasoning_before_a_tool_turn_is_caught():
    tok = make_template_tokenizer("qwen3")
    msgs = [
        Q, {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": [CALC_CALL]},
        RESULT,
    ]
    with pytest.raises(TemplateMismatchError, match="empty <think> block only on the last message"):
        check_incremental(tok, msgs, TOOLS)


def test_qwen3_thinking_disabled_is_exact_for_one_turn_only():
    tok = make_template_tokenizer("qwen3")
    off = {"enable_thinking": False}
    check_incremental(tok, [Q, {"role": "assistant", "content": "12."}], chat_template_kwargs=off)
    msgs = [Q, {"role": "assistant", "content": "", "tool_calls": [CALC_CALL]}, RESULT,
            {"role": "assistant", "content": "12."}]
    with pytest.raises(TemplateMismatchError, match="enable_thinking=False"):
        check_incremental(tok, msgs, TOOLS, chat_template_kwargs=off)


def test_harmony_analysis_before_a_later_final_answer_is_caught():
    tok = make_template_tokenizer("harmony")
    msgs = [
        Q,
        {
            "role": "assistant", "content": "", "thinking": "Use the tool.",
            "tool_calls": [CALC_CALL],
        },
        RESULT,
    ]
    # no final answer yet: exact
    check_incremental(tok, msgs, TOOLS, end_of_turn=STOP_TOKENS["harmony"])
    msgs.append({"role": "assistant", "content": "12."})
    with pytest.raises(TemplateMismatchError, match="analysis channel"):
        check_incremental(tok, msgs, TOOLS, end_of_turn=STOP_TOKENS["harmony"])


def test_harmony_analysis_of_a_final_answer_before_a_user_turn_is_caught():
    tok = make_template_tokenizer("harmony")
    answer = {"role": "assistant", "content": "12.", "thinking": "Easy."}
    msgs = [Q, answer, {"role": "user", "content": "Doubled?"}]
    with pytest.raises(TemplateMismatchError, match="analysis channel"):
        check_incremental(tok, msgs, end_of_turn=STOP_TOKENS["harmony"])
    with pytest.raises(TemplateMismatchError, match="analysis channel"):
        encode_new_turns(tok, [msgs[2]], previous=answer, end_of_turn="<|return|>")


def test_harmony_return_rewritten_as_end_is_caught():
    tok = make_template_tokenizer("harmony")
    msgs = [Q, {"role": "assistant", "content": "12."}, {"role": "user", "content": "Doubled?"}]
    check_incremental(tok, msgs, end_of_turn=STOP_TOKENS["harmony"])
    with pytest.raises(TemplateMismatchError, match=r"<\|return\|> is written as <\|end\|>"):
        check_incremental(
            tok, msgs, end_of_turn=STOP_TOKENS["harmony"],
            chat_template_kwargs={"return_as_end": True},
        )


@pytest.mark.parametrize("message", [
    {"role": "assistant", "content": "It is 12.\n"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [CALC_CALL]},
])
def test_llama_trimmed_or_dropped_assistant_text_is_caught(message):
    tok = make_template_tokenizer("llama3_json")
    with pytest.raises(TemplateMismatchError, match="verbatim"):
        check_incremental(tok, [Q, message], TOOLS)


# --- broken incremental encoders are caught
# ---------------------------------------------------------------

def _conversation(family: str) -> list[dict[str, Any]]:
    first = {"role": "assistant", "content": "", "tool_calls": [CALC_CALL]}
    if family == "qwen3":
        first["reasoning_content"] = "Use the tool."
    return [
        {"role": "system", "content": "Be brief."}, Q, first, RESULT,
        {"role": "assistant", "content": "12."},
    ]


BREAKAGES = [(f, b) for f in sorted(FAMILIES) for b in ("no_generation_prompt", "drop_first_token")]
BREAKAGES += [("chatml_hermes", "no_separator"), ("qwen3", "no_separator")]


@pytest.mark.parametrize("family, breakage", BREAKAGES)
def test_broken_encoder_is_caught(family, breakage, monkeypatch):
    tok = make_template_tokenizer(family)
    msgs = _conversation(family)
    check_incremental(tok, msgs, TOOLS, end_of_turn=STOP_TOKENS[family])
    real = inc.encode_new_turns

    def broken(tokenizer: Any, new: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        if breakage == "no_generation_prompt":
            kwargs["add_generation_prompt"] = False
        ids = real(tokenizer, new, **kwargs)
        return ids[1:] if breakage == "drop_first_token" else ids

    monkeypatch.setattr(inc, "encode_new_turns", broken)
    if breakage == "no_separator":
        monkeypatch.setattr(inc, "turn_separator", lambda tokenizer, eos_token=None: "")
    with pytest.raises(TemplateMismatchError, match="differ from the full render"):
        check_incremental(tok, msgs, TOOLS, end_of_turn=STOP_TOKENS[family])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prompt_encoding_fast_path_gives_hf_ids(family):
    """agent loops encode prompts with the Rust backend directly; the ids must be exactly HF's."""
    from agentloop.loops.prompt import apply_chat_template
    from agentloop.tokenization.fast import fast_backend

    tok = make_template_tokenizer(family)
    assert fast_backend(tok) is not None
    rng = random.Random(f"fast-path-{family}")
    for _ in range(20):
        msgs, tools, kwargs = random_conversation(rng, family)
        if msgs[-1]["role"] == "assistant":
            msgs = msgs[:-1]
        expected = tok.apply_chat_template(
            msgs, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False,
            **kwargs,
        )
        assert apply_chat_template(
            tok, msgs, tools=tools, add_generation_prompt=True, **kwargs
        ) == list(expected)


def test_prompt_encoding_falls_back_when_the_backend_would_truncate():
    """Truncation left on the Rust tokenizer (HF resets it per call) must not leak into a prompt."""
    from agentloop.loops.prompt import apply_chat_template
    from agentloop.tokenization.fast import fast_backend

    tok = make_template_tokenizer("chatml_hermes")
    msgs = [{"role": "user", "content": "What is 12 + 30? " * 20}]
    expected = list(
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    tok._tokenizer.enable_truncation(max_length=8)
    try:
        assert fast_backend(tok) is None
        assert apply_chat_template(tok, msgs, add_generation_prompt=True) == expected
    finally:
        tok._tokenizer.no_truncation()
    assert len(expected) > 8
