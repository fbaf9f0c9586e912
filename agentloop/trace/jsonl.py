"""The ``jsonl`` trace backend: one JSON object per span, appended to a file.

Values are made JSON-safe by :func:`to_jsonable`: pydantic models are dumped, numpy / torch arrays
become lists, lists longer than ``max_list_items`` keep their head and end with a
``"... (+N more)"`` marker, strings longer than ``max_str_chars`` are cut the same way, and anything
else falls back to ``repr``.

Several processes may append to one file: the file is opened with ``O_APPEND`` and each span is
written with a single ``write`` call, so lines do not interleave on a local file system.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from agentloop.errors import ConfigError

DEFAULT_MAX_LIST_ITEMS = 1000
DEFAULT_MAX_STR_CHARS = 100_000
_MAX_DEPTH = 32
_PAYLOAD = frozenset({"inputs", "outputs", "attrs"})
"""Record fields the size limits apply to (the rest is the span's envelope: name, ids, times)."""


def _more(n: int) -> str:
    return f"... (+{n} more)"


def _sequence(value: Sequence[Any], max_items: int, max_chars: int, depth: int) -> list[Any]:
    out = [to_jsonable(v, max_items, max_chars, depth + 1) for v in value[:max_items]]
    extra = len(value) - len(out)
    if extra > 0:
        out.append(_more(extra))
    return out


def _array(value: Any, max_items: int, max_chars: int, depth: int) -> Any:
    """numpy arrays, torch tensors and their scalars: slice before ``tolist`` so huge arrays stay
    cheap."""
    shape = getattr(value, "shape", None)
    if shape is None or len(shape) == 0:
        return to_jsonable(
            value.item() if hasattr(value, "item") else value.tolist(), max_items, max_chars, depth
        )
    head = value[:max_items]
    if hasattr(head, "detach"):
        head = head.detach().cpu()
    out = [to_jsonable(v, max_items, max_chars, depth + 1) for v in head.tolist()]
    if shape[0] > max_items:
        out.append(_more(int(shape[0]) - max_items))
    return out


def to_jsonable(
    value: Any, max_list_items: int = DEFAULT_MAX_LIST_ITEMS,
    max_str_chars: int = DEFAULT_MAX_STR_CHARS, _depth: int = 0,
) -> Any:
    """A JSON-safe copy of ``value`` (see the module docstring for the rules)."""
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        return (
            value
            if len(value) <= max_str_chars
            else value[:max_str_chars] + _more(len(value) - max_str_chars)
        )
    if _depth >= _MAX_DEPTH:
        return repr(value)[:max_str_chars]
    if isinstance(value, enum.Enum):
        return to_jsonable(value.value, max_list_items, max_str_chars, _depth + 1)
    if isinstance(value, BaseModel):
        return to_jsonable(value.model_dump(), max_list_items, max_str_chars, _depth + 1)
    if isinstance(value, Mapping):
        return {
            str(k): to_jsonable(v, max_list_items, max_str_chars, _depth + 1)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return _sequence(value, max_list_items, max_str_chars, _depth)
    if isinstance(value, (set, frozenset)):
        try:
            ordered = sorted(value)
        except TypeError:
            ordered = list(value)
        return _sequence(ordered, max_list_items, max_str_chars, _depth)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return to_jsonable(fields, max_list_items, max_str_chars, _depth + 1)
    if hasattr(value, "tolist") and hasattr(value, "shape"):
        try:
            return _array(value, max_list_items, max_str_chars, _depth)
        except Exception:  # noqa: BLE001 - an exotic array type: fall back to repr
            pass
    if isinstance(value, (bytes, bytearray, Path)):
        return to_jsonable(
            str(value) if isinstance(value, Path) else repr(value), max_list_items, max_str_chars
        )
    return to_jsonable(repr(value), max_list_items, max_str_chars)


class JsonlBackend:
    """Appends one JSON line per span to ``path`` (``{pid}`` in the path is replaced by the process
    id).

    Args:
        path: the file to append to; parent directories are created.
        max_list_items: lists / arrays longer than this are truncated in the record.
        max_str_chars: strings longer than this are truncated in the record.
    """

    name = "jsonl"

    def __init__(
        self, path: str | os.PathLike[str], max_list_items: int = DEFAULT_MAX_LIST_ITEMS,
        max_str_chars: int = DEFAULT_MAX_STR_CHARS,
    ) -> None:
        if max_list_items < 1 or max_str_chars < 1:
            raise ConfigError(
                f"trace limits must be positive, got max_list_items={max_list_items}, "
                f"max_str_chars={max_str_chars}; pass values >= 1"
            )
        self.path = Path(str(path).replace("{pid}", str(os.getpid()))).expanduser()
        self.max_list_items = max_list_items
        self.max_str_chars = max_str_chars
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            raise ConfigError(
                f"cannot open trace file {str(self.path)!r} for appending ({e.strerror}); "
                "pass a writable path to agentloop.trace.configure(backend='jsonl', path=...)"
            ) from None
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line; the limits apply to its ``inputs``, ``outputs`` and
        ``attrs``."""
        safe = {
            k: to_jsonable(v, self.max_list_items, self.max_str_chars)
            if k in _PAYLOAD
            else to_jsonable(v)
            for k, v in record.items()
        }
        data = (json.dumps(safe, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")
        with self._lock:
            if self._fd is None:
                return
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]

    def close(self) -> None:
        """Close the file; later writes are dropped."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __repr__(self) -> str:
        return f"JsonlBackend(path={str(self.path)!r})"
