"""Do a trajectory's non-sampled tokens equal the chat template's rendering of its conversation?

:func:`check_trajectory` renders the saved conversation (``multi_turn.return_messages``) with the
tokenizer's own chat template and checks, independently of agentloop's encoder, that it starts with
the prompt's rendering and holds each mask-0 run of the response (tool / user turns) in order; the
assistant turns in between are not compared.  The exact rule: docs/report.md#the-template-check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class TemplateProblem:
    """A trajectory whose mask-0 tokens are not the template's."""

    row: int
    message: str


def mask_runs(mask: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs of equal values: ``(value, start, end)`` with ``end`` exclusive."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((int(mask[start]), start, i))
            start = i
    return runs


def find(haystack: list[int], needle: list[int], start: int) -> int:
    """First index ``>= start`` where ``needle`` occurs in ``haystack``, or -1."""
    if not needle:
        return start
    first, n = needle[0], len(needle)
    for i in range(start, len(haystack) - n + 1):
        if haystack[i] == first and haystack[i:i + n] == needle:
            return i
    return -1


def render(
    tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> list[int]:
    """The chat template's text for ``messages``, encoded by the tokenizer (no special tokens
    added)."""
    text = tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def check_trajectory(
    tokenizer: Any, row: int, prompt_messages: list[dict[str, Any]], messages: list[dict[str, Any]],
    response_ids: np.ndarray, response_mask: np.ndarray,
) -> tuple[int, TemplateProblem | None]:
    """Check one trajectory (docs/report.md#the-template-check); returns how many mask-0 runs were
    checked and the problem found, if any.  ``response_ids`` / ``response_mask`` are the row's
    unpadded response."""
    prompt_msgs = [dict(m) for m in prompt_messages]
    full = render(
        tokenizer, [dict(m) for m in messages],
        add_generation_prompt=messages[-1].get("role") != "assistant",
    )
    head = render(tokenizer, prompt_msgs, add_generation_prompt=True)
    if full[:len(head)] != head:
        return 0, TemplateProblem(
            row,
            "the template's rendering of the conversation does "
            "not start with its "
            "rendering of the prompt; this template cannot be "
            "checked turn by turn",
        )
    ids = [int(t) for t in response_ids]
    pos, checked = len(head), 0
    for value, start, end in mask_runs(np.asarray(response_mask)):
        if value:
            continue
        run = ids[start:end]
        at = find(full, run, pos)
        if at < 0:
            text = tokenizer.decode(run, skip_special_tokens=False)
            return checked, TemplateProblem(
                row,
                f"the mask-0 tokens at response positions "
                f"{start}..{end - 1} "
                f"({text[:80]!r}) are not the template's "
                f"rendering of the "
                "conversation's next tool/user turn",
            )
        pos, checked = at + len(run), checked + 1
    return checked, None
