"""Prompt encoding shared by agent loops: chat template + the prompt-length policy.

A prompt longer than ``rollout.prompt_length`` is left-truncated (its oldest tokens dropped, verl's
behaviour) and the number of dropped tokens is returned so the worker can count it; with
``rollout.agent.prompt_truncation: error`` it raises :class:`PromptTooLongError` instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from agentloop.errors import DatasetError, PromptTooLongError


def as_messages(raw_prompt: Any) -> list[dict[str, Any]]:
    """Normalise a ``raw_prompt`` cell (list / numpy array of dicts, or a bare string) to a message list."""
    if isinstance(raw_prompt, str):
        return [{"role": "user", "content": raw_prompt}]
    if isinstance(raw_prompt, np.ndarray):
        raw_prompt = raw_prompt.tolist()
    if not isinstance(raw_prompt, (list, tuple)) or not all(isinstance(m, dict) for m in raw_prompt):
        raise DatasetError(
            "raw_prompt must be a list of chat messages ({'role': ..., 'content': ...}), got "
            f"{type(raw_prompt).__name__}: {str(raw_prompt)[:200]}"
        )
    return [dict(m) for m in raw_prompt]


def _fast_backend(tokenizer: Any) -> Any | None:
    """The Rust ``tokenizers.Tokenizer`` behind a fast HF tokenizer, when encoding with it directly gives
    exactly what ``tokenizer(text, add_special_tokens=False)`` gives: no truncation or padding set on it
    (HF resets both per call; a direct call would apply leftovers) and no special-token splitting."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "encode") or getattr(tokenizer, "split_special_tokens", False):
        return None
    if getattr(backend, "truncation", None) is not None or getattr(backend, "padding", None) is not None:
        return None
    return backend


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """``tokenizer.apply_chat_template(..., tokenize=True)`` returning plain ids on transformers 4 and 5.

    With a fast tokenizer the rendered text is encoded by its Rust backend directly (the same call HF
    makes, without ~20 µs of Python around it per prompt); ``tests/unit/test_tokenization_families.py``
    checks the ids are identical.
    """
    backend = _fast_backend(tokenizer)
    if backend is not None:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        if isinstance(text, str):
            return list(backend.encode(text, add_special_tokens=False).ids)
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def fit_prompt(prompt_ids: list[int], prompt_length: int, policy: str) -> tuple[list[int], int]:
    """Apply the prompt-length policy; returns the ids kept and how many were dropped."""
    extra = len(prompt_ids) - prompt_length
    if extra <= 0:
        return prompt_ids, 0
    if policy == "error":
        raise PromptTooLongError(
            f"prompt has {len(prompt_ids)} tokens but rollout.prompt_length is {prompt_length}; raise "
            "prompt_length, shorten the data, or set actor_rollout_ref.rollout.agent.prompt_truncation=left"
        )
    return prompt_ids[extra:], extra
