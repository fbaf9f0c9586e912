"""Exact incremental encoding of non-assistant turns (tool results, user / interaction turns).

:func:`encode_new_turns` returns the ids of new messages appended after the policy's sampled ids
(never re-tokenized), so the running sequence equals the chat template's full render: the difference
of two renders of a stand-in conversation plus the separator after the end-of-turn token the sample
ended with. :func:`check_incremental` replays a conversation turn by turn and compares with a full
render. Both raise :class:`TemplateMismatchError` (with the reason) when the template is not
prefix-stable. Spec (the method, end-of-turn tokens, what is exact per template family):
docs/tokenization.md#incremental-encoding.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from typing import Any

from agentloop.errors import AgentLoopError
from agentloop.tokenization.fast import encode_text
from agentloop.tokenization.turn_cache import recall, remember, turn_key, without_call_ids

_STUB = "AGENTLOOP_STUB"
# Reasoning keeps Qwen3-style templates rendering the stub's <think> block whether or not it is
# last.
_STUB_REPLY: dict[str, Any] = {"role": "assistant", "content": _STUB, "reasoning_content": _STUB}
_STUB_CALL: dict[str, Any] = {
    "role": "assistant", "content": "",
    "tool_calls": [{"type": "function", "function": {"name": _STUB, "arguments": {}}}],
}
# (text the dropped part starts with, within so many chars, why)
_HINTS: tuple[tuple[str, int, str], ...] = (
    (
        "<think>",
        16,
        "the reasoning (<think> block) of an earlier assistant turn is dropped "
        "from the history: Qwen3 "
        "renders reasoning only for turns after the last user query, and an "
        "empty <think> block only "
        "on the last message (so enable_thinking=False never survives a second turn)",
    ),
    (
        "analysis<|message|>",
        32,
        "the analysis channel (chain of thought) of an earlier "
        "assistant turn is dropped "
        "from the history: harmony keeps it only until a final "
        "answer follows",
    ),
    (
        "<|return|>",
        10,
        "the final answer's <|return|> is written as <|end|> in the history "
        "(OpenAI's harmony "
        "template), but the policy sampled <|return|>",
    ),
)


class TemplateMismatchError(AgentLoopError):
    """Incremental and full renders of a conversation differ."""


def _render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return encode_text(tokenizer, text)


def _stub_history(
    system: dict[str, Any] | None, previous: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    stub = [{"role": "user", "content": _STUB}, previous or _STUB_REPLY]
    return ([system] if system else []) + stub


def _common_prefix(a: str, b: str) -> int:
    return next(
        (k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _explain_rerender(before: str, after: str, where: str) -> str:
    """Why ``before`` (an earlier render) is not a prefix of ``after`` (a render with more
    messages)."""
    at = _common_prefix(before, after)
    lo = max(0, at - 30)
    # back off a little: the two renders may share the first characters of a tag ("<t" of "<think>")
    reasons = [hint for marker, span, hint in _HINTS if marker in before[max(0, at - 8):at + span]]
    return (
        f"the chat template re-renders earlier turns when new ones are added, so "
        f"incremental encoding is not "
        f"exact for this conversation: {where} renders {before[lo : at + 50]!r}, the longer "
        f"conversation "
        f"{after[lo : at + 50]!r} (character {at})" + "".join(f"; {reason}" for reason in reasons)
    )


def _assistant_body(tokenizer: Any, message: dict[str, Any], tools: list[dict[str, Any]] | None,
                    kwargs: dict[str, Any]) -> str:
    """The template's text for ``message`` after the generation prompt: what the policy samples."""
    stub = [{"role": "user", "content": _STUB}]
    head = _render(tokenizer, stub, tools=tools, add_generation_prompt=True, **kwargs)
    full = _render(tokenizer, stub + [message], tools=tools, **kwargs)
    if not full.startswith(head):
        raise TemplateMismatchError(
            "the generation prompt is not how the chat template starts an assistant turn: "
            + _explain_rerender(head, full, "the prompt with its generation prompt")
        )
    return full[len(head):]


_separators: weakref.WeakKeyDictionary[Any, dict[tuple[str, str], str]] = (
    weakref.WeakKeyDictionary()
)


def turn_separator(tokenizer: Any, eos_token: str | None = None) -> str:
    """Text the template puts after an assistant turn's end-of-turn token (``"\\n"`` for ChatML,
    ``""`` for Llama).

    ``eos_token`` (default ``tokenizer.eos_token``) is the token the turn ended with; a template
    that ends tool-call turns with their own token (harmony's ``<|call|>``) is looked up on a
    tool-call stub. Remembered per tokenizer, chat template and token (it is asked on every tool
    turn and costs two to four renders).
    """
    eos = eos_token or tokenizer.eos_token
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):  # no template of its own, or several by name: not remembered
        return find_separator(tokenizer, eos)
    try:
        known = _separators.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable
        return find_separator(tokenizer, eos)
    if (template, eos) not in known:
        known[(template, eos)] = find_separator(tokenizer, eos)
    return known[(template, eos)]


def find_separator(tokenizer: Any, eos: str) -> str:
    """The text a template puts between an assistant turn's end-of-turn token and the next turn,
    found by rendering stub conversations (cached per template by the caller)."""
    for stub in (_STUB_REPLY, _STUB_CALL):
        try:
            body = _assistant_body(tokenizer, stub, None, {})
        except Exception:  # a template may reject this stub (e.g. a tool call): try the next one
            continue
        end = body.rfind(eos)
        if end >= 0:
            return body[end + len(eos):]
    raise TemplateMismatchError(f"the chat template does not close assistant turns with {eos!r}")


_ID_WORDS = re.compile(r"\bid\b|tool_call_id")
_call_ids_rendered: weakref.WeakKeyDictionary[Any, dict[tuple[str, bool, str], bool]] = (
    weakref.WeakKeyDictionary()
)


def _call_id_probe(call_id: str) -> list[dict[str, Any]]:
    call = {"id": call_id, "type": "function", "function": {"name": _STUB, "arguments": {}}}
    return [
        {"role": "user", "content": _STUB},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": _STUB, "tool_call_id": call_id, "name": _STUB},
    ]


def _renders_call_ids(
    tokenizer: Any, tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]
) -> bool:
    """Whether the chat template may write tool-call ids into a render: its text names ``id`` or
    ``tool_call_id``, or a stub tool call renders differently under two ids (a dict dumped whole).
    True when unsure (a template of several names, a probe the template rejects)."""
    template = kwargs.get("chat_template") or getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return True
    key = (template, tools is None, repr(sorted(kwargs.items())))
    try:
        known = _call_ids_rendered.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: not remembered
        known = {}
    if key not in known and _ID_WORDS.search(template):
        known[key] = True
    elif key not in known:
        try:
            first = _render(tokenizer, _call_id_probe("call_A1"), tools=tools, **kwargs)
            known[key] = first != _render(
                tokenizer, _call_id_probe("call_B2"), tools=tools, **kwargs
            )
        except Exception:  # noqa: BLE001 - a template that rejects the probe: keep the ids
            known[key] = True
    return known[key]


def encode_new_turns(
    tokenizer: Any, new_messages: list[dict[str, Any]], *, system: dict[str, Any] | None = None,
    add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
    previous: dict[str, Any] | None = None, end_of_turn: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Ids to append after an assistant turn that ended with its end-of-turn token.

    Args:
        new_messages: the tool / user messages to add.
        system: the conversation's system message, for templates whose rendering depends on it.
        add_generation_prompt: append the header of the next assistant turn.
        tools: the tool schemas, for templates that render differently with tools.
        previous: the assistant message the new ones follow (harmony names tool results after its
        call;
            other templates only need it for the re-render check).  A placeholder when ``None``.
        end_of_turn: the token that turn ended with (default ``tokenizer.eos_token``).
        chat_template_kwargs: extra template variables (``enable_thinking``, ``reasoning_effort``,
        ...).

    Raises:
        TemplateMismatchError: the template renders ``previous`` differently once the new messages
        follow.
    """
    kwargs = dict(chat_template_kwargs or {})
    # remembered per tokenizer: rows of one GRPO prompt often append the same turn (tool-call ids
    # differ per row, so they are left out of the key when the template does not render them)
    keyed_new, keyed_previous = new_messages, previous
    if not _renders_call_ids(tokenizer, tools, kwargs):
        keyed_new, keyed_previous = without_call_ids(new_messages, previous)
    key = turn_key(
        tokenizer, [keyed_new, system, add_generation_prompt, keyed_previous, end_of_turn,
                    getattr(tokenizer, "eos_token", None)],
        kwargs, tools,
    )
    known = None if key is None else recall(tokenizer, key)
    if known is not None:
        return known
    stub = _stub_history(system, previous)
    base = _render(tokenizer, stub, tools=tools, **kwargs)
    full = _render(
        tokenizer, stub + list(new_messages), tools=tools,
        add_generation_prompt=add_generation_prompt, **kwargs,
    )
    if not full.startswith(base):
        raise TemplateMismatchError(
            _explain_rerender(base, full, "the assistant turn before the new messages")
        )
    delta = turn_separator(tokenizer, end_of_turn) + full[len(base):]
    ids = _encode(tokenizer, delta)
    if key is not None:
        remember(tokenizer, key, ids)
    return ids


def _stop_tokens(tokenizer: Any, end_of_turn: str | Sequence[str] | None) -> tuple[str, ...]:
    if end_of_turn is None:
        return (tokenizer.eos_token,)
    return (end_of_turn,) if isinstance(end_of_turn, str) else tuple(end_of_turn)


def _token_id(tokenizer: Any, token: str) -> int:
    ids = _encode(tokenizer, token)
    if len(ids) != 1:
        raise TemplateMismatchError(
            f"end-of-turn {token!r} is not a single token of this tokenizer: {ids}"
        )
    return ids[0]


def assistant_text(tokenizer: Any, message: dict[str, Any], tools: list[dict[str, Any]] | None,
                   stops: tuple[str, ...], kwargs: dict[str, Any]) -> tuple[str, str]:
    """What the policy would have sampled for the assistant ``message`` before its stop token, and
    that token.

    ``stops`` are the end-of-turn strings to look for in the template's render of the message (with
    ``tools`` and the chat-template ``kwargs``).  Returns ``(text, stop)``.  Raises
    :class:`TemplateMismatchError` where the render ends with none of ``stops`` or does not hold the
    message's content verbatim.
    """
    body = _assistant_body(tokenizer, message, tools, kwargs)
    end, stop = max((body.rfind(s), s) for s in stops)
    if end < 0:
        raise TemplateMismatchError(
            f"the chat template ends no assistant turn with any of {stops}: {body!r}"
        )
    content = message.get("content")
    if isinstance(content, str) and content and content not in body[:end]:
        raise TemplateMismatchError(
            f"the chat template does not render the assistant content {content!r} verbatim "
            f"(it renders "
            f"{body[:end]!r}: trimmed, rewritten or dropped), so ids sampled for it cannot "
            f"equal a re-render"
        )
    return body[:end], stop


def _check_prefix_stable(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any],
) -> None:
    """Every render a rollout saw (before / after each assistant turn) must start the full
    render."""
    full = _render(tokenizer, messages, tools=tools, **kwargs)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        for n, prompt in ((k, True), (k + 1, False)):
            if n == 0 or n == len(messages):
                continue
            part = _render(
                tokenizer, messages[:n], tools=tools, add_generation_prompt=prompt, **kwargs
            )
            if not full.startswith(part):
                where = f"the conversation up to message {n - 1} ({messages[n - 1]['role']})" + (
                    " with the generation prompt" if prompt else "")
                raise TemplateMismatchError(_explain_rerender(part, full, where))


def _replay(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            stops: tuple[str, ...], kwargs: dict[str, Any]) -> tuple[list[int], str | None]:
    """Ids a rollout would hold after ``messages``, and the stop token of the last assistant
    turn."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    ids = _encode(
        tokenizer,
        _render(tokenizer, messages[:first], tools=tools, add_generation_prompt=True, **kwargs),
    )
    system = messages[0] if messages and messages[0]["role"] == "system" else None
    stop: str | None = None
    i = first
    while i < len(messages):
        if messages[i]["role"] == "assistant":
            text, stop = assistant_text(tokenizer, messages[i], tools, stops, kwargs)
            ids += _encode(tokenizer, text) + [_token_id(tokenizer, stop)]
            i += 1
            continue
        j = i
        while j < len(messages) and messages[j]["role"] != "assistant":
            j += 1
        ids += encode_new_turns(tokenizer, messages[i:j], system=system, tools=tools,
                                add_generation_prompt=j < len(messages), previous=messages[i - 1],
                                end_of_turn=stop, chat_template_kwargs=kwargs)
        i = j
    return ids, stop


def check_incremental(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
    end_of_turn: str | Sequence[str] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Replay ``messages`` turn by turn as a rollout would; raise on any difference from a full
    render.

    The first assistant turn starts after the prompt (all messages before it, generation prompt
    appended); assistant turns are encoded as sampled (the template's text for them + the stop
    token); every run of non-assistant messages goes through :func:`encode_new_turns`.  Returns the
    incremental ids.

    Args:
        end_of_turn: the token(s) the engine stops on (default ``tokenizer.eos_token``); each
        assistant
            turn must end with one of them, e.g. ``("<|return|>", "<|call|>")`` for harmony.
        chat_template_kwargs: extra template variables, passed to every render.

    Raises:
        TemplateMismatchError: the template is not prefix-stable for this conversation (the message
        says
            which turn is re-rendered and, for known cases, why), renders assistant text differently
            from its content, or the incremental ids differ from the full render.
    """
    kwargs = dict(chat_template_kwargs or {})
    stops = _stop_tokens(tokenizer, end_of_turn)
    _check_prefix_stable(tokenizer, messages, tools, kwargs)
    ids, stop = _replay(tokenizer, messages, tools, stops, kwargs)
    expected = _encode(tokenizer, _render(tokenizer, messages, tools=tools, **kwargs))
    ids_cmp = ids
    if messages and messages[-1]["role"] == "assistant":
        ids_cmp = ids + _encode(tokenizer, turn_separator(tokenizer, stop))
    if ids_cmp != expected:
        at = next((k for k, (a, b) in enumerate(zip(ids_cmp, expected, strict=False)) if a != b),
                  min(len(ids_cmp), len(expected)))
        raise TemplateMismatchError(
            f"incremental ids differ from the full render at token {at}: "
            f"{tokenizer.decode(ids_cmp[at : at + 12])!r} vs "
            f"{tokenizer.decode(expected[at : at + 12])!r}"
        )
    return ids
