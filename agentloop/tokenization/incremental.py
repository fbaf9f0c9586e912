"""Exact incremental encoding of non-assistant turns (tool results, user / interaction turns).

The policy's sampled ids are kept as they are; a new turn appended after them must make the running
sequence equal to what the chat template renders for the whole conversation.  We never re-render the
history: the new turn's ids are the *difference* between two renders of a stand-in conversation,

    delta = render(stub + new, add_generation_prompt) - render(stub)

plus the template's separator after an assistant turn's end token (ChatML's ``\\n`` after
``<|im_end|>``, the classic trap: the engine stops *at* ``<|im_end|>``, the template writes ``\\n`` after
it).  :func:`check_incremental` replays a conversation turn by turn and compares the result with a full
render, token for token.
"""

from __future__ import annotations

from typing import Any

from agentloop.errors import AgentLoopError

_STUB = "AGENTLOOP_STUB"


class TemplateMismatchError(AgentLoopError):
    """Incremental and full renders of a conversation differ."""


def _render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def _stub_history(system: dict[str, Any] | None) -> list[dict[str, Any]]:
    stub = [{"role": "user", "content": _STUB}, {"role": "assistant", "content": _STUB}]
    return ([system] if system else []) + stub


def turn_separator(tokenizer: Any, eos_token: str | None = None) -> str:
    """Text the template puts after an assistant turn's end-of-turn token (``"\\n"`` for ChatML)."""
    eos = eos_token or tokenizer.eos_token
    text = _render(tokenizer, _stub_history(None))
    end = text.rfind(eos)
    if end < 0:
        raise TemplateMismatchError(f"the chat template does not close assistant turns with {eos!r}")
    return text[end + len(eos):]


def encode_new_turns(
    tokenizer: Any,
    new_messages: list[dict[str, Any]],
    *,
    system: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Ids to append after an assistant turn that ended with its end-of-turn token.

    Args:
        new_messages: the tool / user messages to add.
        system: the conversation's system message, for templates whose rendering depends on it.
        add_generation_prompt: append the header of the next assistant turn.
        tools: the tool schemas, for templates that render differently with tools.
    """
    stub = _stub_history(system)
    base = _render(tokenizer, stub, tools=tools)
    full = _render(tokenizer, stub + list(new_messages), tools=tools, add_generation_prompt=add_generation_prompt)
    if not full.startswith(base):
        raise TemplateMismatchError(
            "the chat template re-renders earlier turns when new ones are added; incremental encoding "
            "is not exact for it (see agentloop.tokenization)"
        )
    delta = turn_separator(tokenizer) + full[len(base):]
    return list(tokenizer.encode(delta, add_special_tokens=False))


def check_incremental(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Replay ``messages`` turn by turn as a rollout would; raise on any difference from a full render.

    The first assistant turn starts after the prompt (all messages before it, generation prompt
    appended); assistant turns are encoded as sampled (content ids + end-of-turn token); every run of
    non-assistant messages goes through :func:`encode_new_turns`.  Returns the incremental ids.
    """
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    ids = _encode(tokenizer, _render(tokenizer, messages[:first], tools=tools, add_generation_prompt=True))
    system = messages[0] if messages and messages[0]["role"] == "system" else None
    i = first
    while i < len(messages):
        if messages[i]["role"] == "assistant":
            ids += _encode(tokenizer, _assistant_text(tokenizer, messages[i], tools)) + [tokenizer.eos_token_id]
            i += 1
            continue
        j = i
        while j < len(messages) and messages[j]["role"] != "assistant":
            j += 1
        ids += encode_new_turns(tokenizer, messages[i:j], system=system, tools=tools,
                                add_generation_prompt=j < len(messages))
        i = j
    expected = _encode(tokenizer, _render(tokenizer, messages, tools=tools))
    if messages and messages[-1]["role"] == "assistant":
        ids_cmp = ids + _encode(tokenizer, turn_separator(tokenizer))
    else:
        ids_cmp = ids
    if ids_cmp != expected:
        at = next((k for k, (a, b) in enumerate(zip(ids_cmp, expected, strict=False)) if a != b),
                  min(len(ids_cmp), len(expected)))
        raise TemplateMismatchError(
            f"incremental ids differ from the full render at token {at}: "
            f"{tokenizer.decode(ids_cmp[at:at + 12])!r} vs {tokenizer.decode(expected[at:at + 12])!r}"
        )
    return ids


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _assistant_text(tokenizer: Any, message: dict[str, Any], tools: list[dict[str, Any]] | None) -> str:
    """What the policy would have sampled for ``message`` (the template's rendering of its body)."""
    stub = [{"role": "user", "content": _STUB}]
    head = _render(tokenizer, stub, tools=tools, add_generation_prompt=True)
    full = _render(tokenizer, stub + [message], tools=tools)
    body = full[len(head):]
    end = body.rfind(tokenizer.eos_token)
    return body[:end]
