"""Prompt encoding shared by agent loops: chat template + the prompt-length policy.

A prompt longer than ``rollout.prompt_length`` is left-truncated (its oldest tokens dropped, verl's
behaviour) and the number of dropped tokens is returned so the worker can count it; with
``rollout.agent.prompt_truncation: error`` it raises :class:`PromptTooLongError` instead.
"""

from __future__ import annotations

import array
import functools
import hashlib
import json
import threading
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np

from agentloop.errors import DatasetError, PromptTooLongError
from agentloop.tokenization.fast import encode_with_backend
from agentloop.tokenization.fast import fast_backend as _fast_backend
from agentloop.tokenization.schema_json import tools_json


def as_messages(raw_prompt: Any) -> list[dict[str, Any]]:
    """Normalise a ``raw_prompt`` cell (list / numpy array of dicts, or a bare string) to a
    message list."""
    if isinstance(raw_prompt, str):
        return [{"role": "user", "content": raw_prompt}]
    if isinstance(raw_prompt, np.ndarray):
        raw_prompt = raw_prompt.tolist()
    if not isinstance(raw_prompt, (list, tuple)) or not all(
        isinstance(m, dict) for m in raw_prompt
    ):
        raise DatasetError(
            "raw_prompt must be a list of chat messages ({'role': ..., 'content': ...}), got "
            f"{type(raw_prompt).__name__}: {str(raw_prompt)[:200]}"
        )
    return [dict(m) for m in raw_prompt]


RENDER_CACHE_SIZE = 1024
"""Distinct renders remembered per tokenizer (0 turns the cache off)."""
_Key = tuple[Any, ...]
_render_caches: weakref.WeakKeyDictionary[Any, OrderedDict[_Key, array.array]] = (
    weakref.WeakKeyDictionary()
)
_render_lock = threading.Lock()


_last_render: tuple[Any, ...] | None = None
"""The last render the cache took, to compare the next one with before any key is built: GRPO
batches hold each prompt ``rollout.n`` times in a row, and their renders run one after another
(:func:`_same_as_last`)."""


def clear_render_cache() -> None:
    """Forget every remembered render (all tokenizers)."""
    global _last_render
    with _render_lock:
        _render_caches.clear()
        _last_render = None


def _remember_last(
    tokenizer: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any], key: _Key,
    ids: array.array,
) -> None:
    """Keep this render as the last one when ``key`` holds its messages and keywords themselves
    (:func:`_plain_key`: strings or None, no tools), which the comparison in :func:`_same_as_last`
    relies on; otherwise forget the last one."""
    global _last_render
    if len(key) != 4 or key[3] is not None:  # a digest, or tool schemas
        _last_render = None
        return
    try:
        ref = weakref.ref(tokenizer)
    except TypeError:
        return
    _last_render = (
        ref, getattr(tokenizer, "chat_template", None), _vocab_size(tokenizer),
        [dict(m) for m in messages], [tuple(m) for m in messages],
        dict(kwargs), [(k, type(v)) for k, v in kwargs.items()], ids,
    )


def _same_as_last(
    tokenizer: Any, messages: Any, kwargs: dict[str, Any]
) -> array.array | None:
    """The ids of the last render when this one is the same: the same tokenizer, template
    attribute and vocabulary size, messages equal to the last ones with their keys in the same
    order, and keywords equal with the same types (Jinja renders ``True`` and ``1`` differently).
    The last messages were plain (strings or None), so equal ones render the same text."""
    last = _last_render
    if last is None or type(messages) is not list or last[0]() is not tokenizer:
        return None
    (_, template, size, last_messages, last_keys, last_kwargs, last_types, ids) = last
    if (
        messages == last_messages
        and kwargs == last_kwargs
        and [(k, type(v)) for k, v in kwargs.items()] == last_types
        and getattr(tokenizer, "chat_template", None) is template
        and [tuple(m) for m in messages] == last_keys
        and _vocab_size(tokenizer) == size
    ):
        return ids
    return None


def _vocab_size(tokenizer: Any) -> int | None:
    try:
        return len(tokenizer)
    except TypeError:
        return None


def _refuse(value: Any) -> Any:
    raise TypeError(f"not JSON: {type(value).__name__}")


@functools.lru_cache(maxsize=64)
def _reads_clock(template: str) -> bool:
    return "strftime" in template


_PLAIN_KEY_CHARS = 16384


def _plain_key(messages: Any, kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """The messages and keyword arguments themselves as a key, when they are short plain text: every
    message a dict of strings (or None), every keyword a str, bool, int or None (its type is part of
    the key: Jinja renders ``True`` and ``1`` differently although Python finds them equal). Cheaper
    than JSON + a digest."""
    if type(messages) is not list:
        return None
    chars = 0
    parts = []
    for m in messages:
        if type(m) is not dict:
            return None
        for v in m.values():
            if type(v) is str:
                chars += len(v)
            elif v is not None:
                return None
        parts.append(tuple(m.items()))
    if chars > _PLAIN_KEY_CHARS:
        return None
    kw = []
    for k, v in kwargs.items():
        t = type(v)
        if t is not str and t is not bool and t is not int and v is not None:
            return None
        kw.append((k, t, v))
    return tuple(parts), tuple(kw)


def _render_key(tokenizer: Any, messages: Any, kwargs: dict[str, Any]) -> _Key | None:
    """The cache key of one render: the template in use, the vocabulary size (tokens added since
    change the ids) and the messages and keyword arguments: themselves when short plain text
    (:func:`_plain_key`), else a 128-bit BLAKE2 digest of their JSON (small in memory however long
    the conversation; a collision is as likely as guessing a random 128-bit number).

    None (do not cache) when anything is not plain JSON data (an object's repr could name a
    different object later), or when the template reads the clock (``strftime_now``: the render
    changes with the date).
    """
    template = kwargs.get("chat_template") or getattr(tokenizer, "chat_template", None)
    if template is not None and not isinstance(template, (str, dict)):
        return None
    if isinstance(template, dict):
        template = json.dumps(template, sort_keys=True)
    if template is not None and _reads_clock(template):
        return None
    size = _vocab_size(tokenizer)
    tools = kwargs.get("tools")
    rest = kwargs if tools is None else {k: v for k, v in kwargs.items() if k != "tools"}
    try:  # a loop's tool schemas: their JSON remembered per list (schema_json)
        tools_text = None if tools is None else tools_json(tools)
    except (TypeError, ValueError):
        return None
    plain = _plain_key(messages, rest)
    if plain is not None:
        return template, size, plain, tools_text
    try:
        text = json.dumps([messages, rest], ensure_ascii=False, default=_refuse)
    except (TypeError, ValueError):
        return None
    if tools_text is not None:
        text = f"{text}\ntools={tools_text}"
    return (
        template, size,
        hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest(),
    )


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """``tokenizer.apply_chat_template(..., tokenize=True)`` returning plain ids on transformers 4
    and 5.

    With a fast tokenizer the rendered text is encoded by its Rust backend directly (the same call
    HF makes, without ~20 µs of Python around it per prompt);
    ``tests/unit/test_tokenization_families.py`` checks the ids are identical.  Renders are
    remembered per tokenizer (the last :data:`RENDER_CACHE_SIZE` distinct ones, keyed by the
    template and the messages): GRPO batches hold every prompt ``rollout.n`` times in a row, and the
    copies after the first cost a lookup instead of a Jinja render and an encode.
    """
    if RENDER_CACHE_SIZE <= 0:
        return _render(tokenizer, messages, kwargs)
    same = _same_as_last(tokenizer, messages, kwargs)
    if same is not None:
        return same.tolist()
    key = _render_key(tokenizer, messages, kwargs)
    if key is None:
        return _render(tokenizer, messages, kwargs)
    with _render_lock:  # loops may render from threads (the verl helpers use an executor)
        try:
            cache = _render_caches.get(tokenizer)
            if cache is None:
                cache = _render_caches[tokenizer] = OrderedDict()
        except TypeError:  # not weak-referenceable: no cache
            return _render(tokenizer, messages, kwargs)
        hit = cache.get(key)
        if hit is not None:
            cache.move_to_end(key)
            _remember_last(tokenizer, messages, kwargs, key, hit)
            return hit.tolist()
    ids = _render(tokenizer, messages, kwargs)
    stored = array.array("q", ids)
    with _render_lock:
        cache[key] = stored
        while len(cache) > RENDER_CACHE_SIZE:
            cache.popitem(last=False)
        _remember_last(tokenizer, messages, kwargs, key, stored)
    return ids


def _render(tokenizer: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> list[int]:
    backend = _fast_backend(tokenizer)
    if backend is not None:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        if isinstance(text, str):
            return encode_with_backend(backend, text)
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
            f"prompt has {len(prompt_ids)} tokens but rollout.prompt_length is "
            f"{prompt_length}; raise "
            "prompt_length, shorten the data, or set "
            "actor_rollout_ref.rollout.agent.prompt_truncation=left"
        )
    return prompt_ids[extra:], extra
