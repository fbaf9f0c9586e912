"""A per-tokenizer memory of encoded turns, for
:func:`agentloop.tokenization.incremental.encode_new_turns`.

A tool or user turn costs two chat-template renders and an encode (~100 µs); GRPO batches hold each
prompt ``rollout.n`` times, and rows of one prompt often make the same call and get the same result,
so the same turn is encoded again and again.  An entry is keyed by the template, the vocabulary
size and a 128-bit BLAKE2 digest of the JSON of every input of the encoding; inputs that are not
plain JSON data, and templates that read the clock (``strftime``), are not remembered.
"""

from __future__ import annotations

import array
import hashlib
import json
import threading
import weakref
from collections import OrderedDict
from typing import Any

from agentloop.tokenization.schema_json import tools_json

TURN_CACHE_SIZE = 1024
"""Distinct encoded turns remembered per tokenizer (0 turns the memory off)."""
_Key = tuple[Any, int | None, bytes]
_caches: weakref.WeakKeyDictionary[Any, OrderedDict[_Key, array.array]] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()


def _refuse(value: Any) -> Any:
    raise TypeError(f"not JSON: {type(value).__name__}")


def turn_key(
    tokenizer: Any, inputs: list[Any], template_kwargs: dict[str, Any], tools: Any = None
) -> _Key | None:
    """The key of one encoding of ``inputs`` (JSON data) with ``template_kwargs`` and the tool
    schemas ``tools`` (their JSON remembered per list: :mod:`.schema_json`); None: do not remember
    (not JSON, a template that is not one string or reads the clock, or the memory is off)."""
    if TURN_CACHE_SIZE <= 0:
        return None
    template = template_kwargs.get("chat_template") or getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "strftime" in template:
        return None
    try:
        size = len(tokenizer)
    except TypeError:
        size = None
    try:
        text = json.dumps([inputs, template_kwargs], ensure_ascii=False, default=_refuse)
        if tools is not None:  # no JSON text has a raw newline: the two parts stay apart
            text = f"{text}\ntools={tools_json(tools)}"
    except (TypeError, ValueError):
        return None
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return template, size, digest


def without_call_ids(
    new_messages: list[dict[str, Any]], previous: dict[str, Any] | None
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Copies of a turn's inputs for its key, with tool-call ids (``tool_calls[].id``,
    ``tool_call_id``) set to None: for templates that do not render them."""
    new = [{**m, "tool_call_id": None} if "tool_call_id" in m else m for m in new_messages]
    calls = None if previous is None else previous.get("tool_calls")
    if previous is not None and isinstance(calls, list):
        previous = {
            **previous,
            "tool_calls": [{**c, "id": None} if isinstance(c, dict) else c for c in calls],
        }
    return new, previous


def recall(tokenizer: Any, key: _Key) -> list[int] | None:
    """The ids remembered under ``key`` (a fresh list), or None."""
    with _lock:
        cache = _caches.get(tokenizer)
        if cache is None:
            return None
        hit = cache.get(key)
        if hit is None:
            return None
        cache.move_to_end(key)
    return hit.tolist()


def remember(tokenizer: Any, key: _Key, ids: list[int]) -> None:
    """Remember ``ids`` under ``key`` (the oldest entry goes past :data:`TURN_CACHE_SIZE`); a
    tokenizer that cannot be weakly referenced is not remembered."""
    with _lock:
        try:
            cache = _caches.setdefault(tokenizer, OrderedDict())
        except TypeError:
            return
        cache[key] = array.array("q", ids)
        while len(cache) > TURN_CACHE_SIZE:
            cache.popitem(last=False)


def clear_turn_cache() -> None:
    """Forget every remembered turn (all tokenizers)."""
    with _lock:
        _caches.clear()


__all__ = [
    "TURN_CACHE_SIZE", "clear_turn_cache", "recall", "remember", "turn_key", "without_call_ids",
]
