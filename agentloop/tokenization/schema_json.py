"""The JSON text of a loop's tool schemas, remembered per list object, for cache keys.

A tool loop passes the same ``tools`` list (its class's schemas) to every render, and the render
and turn caches key a render by the JSON of its inputs: dumping the schemas again for every key
cost a few µs per render call.  :func:`tools_json` remembers the text per list object with a
deep copy of the list; an entry is used only while the list is the same object and still equals
its copy (a list changed in place is dumped again).  Python's equality takes ``1``, ``1.0`` and
``True`` for one another, so a schema changed in place only from one of these to another would keep
its old text: change schemas by making a new list (every built-in loop does).
"""

from __future__ import annotations

import copy
import json
import threading
from typing import Any

MEMO_SIZE = 64
"""Distinct schema lists remembered (then the memory starts again)."""

_memo: dict[int, tuple[Any, Any, str]] = {}
_lock = threading.Lock()


def _refuse(value: Any) -> Any:
    raise TypeError(f"not JSON: {type(value).__name__}")


def tools_json(tools: Any) -> str:
    """``json.dumps(tools, ensure_ascii=False)``, remembered for a list (see the module docstring).

    Raises:
        TypeError, ValueError: ``tools`` is not JSON data (as ``json.dumps`` raises them).
    """
    if type(tools) is not list:
        return json.dumps(tools, ensure_ascii=False, default=_refuse)
    entry = _memo.get(id(tools))
    if entry is not None and entry[0] is tools and tools == entry[1]:
        return entry[2]
    text = json.dumps(tools, ensure_ascii=False, default=_refuse)
    with _lock:
        if len(_memo) >= MEMO_SIZE:
            _memo.clear()
        _memo[id(tools)] = (tools, copy.deepcopy(tools), text)
    return text
