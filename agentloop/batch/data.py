"""Reading rollout datasets in verl's RL format into a DataProto.

:func:`load_dataset` reads parquet or JSONL rows (``prompt``, optional ``agent_name``,
``data_source``, ``reward_model``, ``extra_info``) into a batch with ``raw_prompt``, ``index``,
``tools_kwargs``, ``interaction_kwargs``, ``uid`` and every other column (:func:`rows_to_batch` for
rows in memory); :func:`repeat_for_rollout` gives verl's GRPO layout (one ``uid`` per prompt, ``n``
interleaved copies). Rows are checked when read, before Ray or an engine starts: a
:class:`~agentloop.errors.DatasetError` names the file, the row, the column and what was found.
Spec: docs/config.md#dataset-rows.
"""

from __future__ import annotations

import json
import operator
import re
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from agentloop.errors import DatasetError

if TYPE_CHECKING:  # torch (via protocol) is imported only once the rows passed their checks
    from agentloop.batch.protocol import DataProto


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Load a ``.parquet`` or ``.jsonl`` file into a list of dicts (a DatasetError names what is
    wrong)."""
    return _read(Path(path).expanduser())[0]


def _read(path: Path) -> tuple[list[dict[str, Any]], list[int] | None]:
    """The rows of ``path`` and, for JSONL, the 1-based line number of each row."""
    if not path.exists():
        raise DatasetError(
            f"dataset file {str(path)!r} does not exist: check "
            f"data.train_files (a .parquet or "
            ".jsonl file; ~ is expanded, relative paths start at the current "
            "directory)"
        )
    if not path.is_file():
        raise DatasetError(
            f"dataset {str(path)!r} is not a file: point data.train_files at "
            f"a .parquet or .jsonl file"
        )
    if path.suffix == ".parquet":
        import pandas as pd  # heavy (~0.5 s): only for parquet files

        try:
            records = pd.read_parquet(path).to_dict(orient="records")
        except Exception as e:  # noqa: BLE001 - pyarrow raises many types for a bad file
            raise DatasetError(
                f"{path}: cannot read it as parquet ({type(e).__name__}: "
                f"{e}); is it a parquet "
                "file (e.g. written by pandas.DataFrame.to_parquet)?"
            ) from e
        return [_plain(r) for r in records], None
    if path.suffix in (".jsonl", ".json"):
        return _read_jsonl(path)
    raise DatasetError(
        f"dataset {str(path)!r}: unsupported extension {path.suffix!r}; use .parquet or .jsonl"
    )


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: cannot read it as UTF-8 text ({type(e).__name__}: {e})") from e
    rows: list[dict[str, Any]] = []
    lines: list[int] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(
                f"{path}:{n}: not valid JSON ({e}); JSONL holds one JSON object per line"
            ) from e
        if not isinstance(row, dict):
            raise DatasetError(
                f'{path}:{n}: a row must be a JSON object like {{"prompt": '
                f"[...]}}, "
                f"got {type(row).__name__}"
            )
        rows.append(row)
        lines.append(n)
    return rows, lines


def _plain(value: Any) -> Any:
    """Parquet gives numpy arrays for lists; turn them back into Python lists/dicts recursively."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _got(value: Any) -> str:
    text = json.dumps(value, default=repr) if isinstance(value, str) else repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _message_problem(message: Any) -> str | None:
    """What is wrong with one chat message, or None."""
    if not isinstance(message, dict):
        return f"is not a {{role, content}} dict, got {_got(message)}"
    role = message.get("role")
    if not isinstance(role, str) or not role:
        return f"has no string 'role' (got {_got(role)})"
    content = message.get("content")
    if isinstance(content, str):
        return None
    if content is None:
        if role == "assistant" and message.get("tool_calls"):
            return None  # an assistant turn that only calls tools
        return (f"({role}) has no content: content must be a string or a list of content parts "
                "(null only for an assistant message with tool_calls)")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and isinstance(part.get("type"), str)):
                return (f"({role}) content part {j} must be a dict with a string 'type' "
                        f"(e.g. {{\"type\": \"text\", \"text\": ...}}), got {_got(part)}")
        return None
    return f"({role}) content must be a string or a list of content parts, got {_got(content)}"


def prompt_problem(prompt: Any) -> str | None:
    """What is wrong with one sample's prompt (a chat messages list), or None when it is well
    formed."""
    if not isinstance(prompt, list):
        return f"must be a list of {{role, content}} messages, got {_got(prompt)}"
    if not prompt:
        return "is an empty list: a prompt needs at least one {role, content} message"
    for i, message in enumerate(prompt):
        problem = _message_problem(message)
        if problem is not None:
            return f"message {i} {problem}"
    return None


def validate_rows(rows: list[dict[str, Any]], prompt_key: str = "prompt", source: str = "dataset",
                  lines: list[int] | None = None) -> None:
    """Check every row's prompt (a DatasetError names ``source``, the row and what was found).

    Rows are numbered from 0, as ``pandas.read_parquet(...).iloc[k]``; JSONL rows also give their
    line.
    """
    if not rows:
        raise DatasetError(
            f"{source} has no rows: it is empty; point data.train_files at a dataset with rows"
        )
    for k, row in enumerate(rows):
        where = f"{source} row {k}" + (f" (line {lines[k]})" if lines is not None else "")
        if "raw_prompt" in row:
            column, prompt = "raw_prompt", row["raw_prompt"]
        elif prompt_key in row:
            column, prompt = prompt_key, row[prompt_key]
        else:
            raise DatasetError(
                f"{where} has no {prompt_key!r} column; columns present: {sorted(row)}. Set "
                f"data.prompt_key "
                "to the column holding the chat messages."
            )
        problem = prompt_problem(prompt)
        if problem is not None:
            raise DatasetError(f"{where}: {column} {problem}")


def rows_to_batch(rows: list[dict[str, Any]], prompt_key: str = "prompt", n: int = 1) -> DataProto:
    """Turn dataset rows into a DataProto of samples, each repeated ``n`` times (interleaved).

    Every row's prompt is checked first (:func:`validate_rows`): a malformed row raises
    DatasetError.
    """
    validate_rows(rows, prompt_key)
    return _build_batch(rows, prompt_key, n)


def _build_batch(rows: list[dict[str, Any]], prompt_key: str, n: int) -> DataProto:
    # heavy (torch): once the rows passed their checks
    from agentloop.batch.protocol import DataProto, object_array

    columns: dict[str, list[Any]] = {}
    keys = sorted({k for r in rows for k in r} - {prompt_key, "raw_prompt"})
    columns["raw_prompt"] = [r.get("raw_prompt", r.get(prompt_key)) for r in rows]
    for key in keys:
        columns[key] = [r.get(key) for r in rows]
    extra: list[dict[str, Any]] = [
        e if isinstance(e := r.get("extra_info"), dict) else {} for r in rows
    ]
    columns["index"] = [e.get("index", i) for i, e in enumerate(extra)]
    # verl's RLHFDataset: a sample's tools_kwargs / interaction_kwargs come from extra_info (a
    # top-level
    # column of the same name, agentloop's older form, is kept when present)
    for key in ("tools_kwargs", "interaction_kwargs"):
        top = columns.get(key) or [None] * len(rows)
        columns[key] = [
            t if t is not None else (e.get(key) or {}) for t, e in zip(top, extra, strict=True)
        ]
    columns["uid"] = [str(uuid.uuid4()) for _ in rows]
    batch = DataProto(
        batch=None, non_tensor_batch={k: object_array(v) for k, v in columns.items()}, meta_info={}
    )
    return repeat_for_rollout(batch, n)


def repeat_for_rollout(batch: DataProto, n: int, *, uid_key: str = "uid") -> DataProto:
    """``batch`` ready for ``generate_sequences`` with ``n`` samples per prompt (verl's trainer
    contract).

    Rows without ``non_tensor_batch[uid_key]`` get a fresh ``uuid4`` string each (one per prompt); a
    batch that has the column keeps it.  Then every row is repeated ``n`` times, interleaved
    (``aabb``, as verl's ``batch.repeat(repeat_times=n, interleave=True)``): the ``n`` samples of a
    prompt are adjacent and share its ``uid``, which is what group advantages (GRPO) are computed
    over. ``meta_info`` is kept; ``batch`` itself is not modified.
    """
    try:
        count = operator.index(n)
    except TypeError:
        count = 0
    if isinstance(n, bool) or count < 1:
        raise DatasetError(
            f"repeat_for_rollout: n must be a positive int (samples per prompt), got {n!r}"
        )
    if len(batch) == 0:
        raise DatasetError("repeat_for_rollout: the batch has no rows")
    if uid_key not in batch.non_tensor_batch:
        from agentloop.batch.protocol import DataProto, object_array  # heavy (torch), as above

        uids = object_array([str(uuid.uuid4()) for _ in range(len(batch))])
        batch = DataProto(
            batch=batch.batch, non_tensor_batch={**batch.non_tensor_batch, uid_key: uids},
            meta_info=dict(batch.meta_info),
        )
    return batch.repeat(repeat_times=count, interleave=True) if count > 1 else batch


_MEDIA_MARK = re.compile(r"(<image>|<video>)")


def media_columns(row: dict[str, Any], prompt_key: str = "prompt", image_key: str | None = "images",
                  video_key: str | None = "videos") -> dict[str, Any]:
    """A verl multimodal dataset row as agent loops take it (what verl's RLHFDataset does when it
    reads one): the ``image_key`` / ``video_key`` columns move into ``multi_modal_data``
    (``{"image": [...], "video": [...]}``), and a message content that is a string with ``<image>``
    / ``<video>`` markers becomes content parts (``{"type": "image"}``,
    ``{"type": "text", "text": ...}``), one part per marker in order. Rows without those columns
    come back unchanged."""
    images = row.get(image_key) if image_key else None
    videos = row.get(video_key) if video_key else None
    if images is None and videos is None:
        return row
    out = {k: v for k, v in row.items() if k not in (image_key, video_key)}
    media = dict(out.get("multi_modal_data") or {})
    if images is not None:
        media.setdefault("image", list(images) if isinstance(images, (list, tuple)) else [images])
    if videos is not None:
        media.setdefault("video", list(videos) if isinstance(videos, (list, tuple)) else [videos])
    out["multi_modal_data"] = media
    prompt = out.get(prompt_key)
    if isinstance(prompt, list):
        out[prompt_key] = [_media_parts(m) if isinstance(m, dict) else m for m in prompt]
    return out


def _media_parts(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, str) and _MEDIA_MARK.search(content):
        parts: list[dict[str, Any]] = []
        for piece in _MEDIA_MARK.split(content):
            if piece in ("<image>", "<video>"):
                parts.append({"type": piece[1:-1]})
            elif piece:
                parts.append({"type": "text", "text": piece})
        return {**message, "content": parts}
    # parquet gives every part all the struct's keys: drop the empty ones
    if isinstance(content, list):
        return {
            **message,
            "content": [
                {k: v for k, v in p.items() if v is not None} if isinstance(p, dict) else p
                for p in content
            ],
        }
    return message


def load_dataset(path: str | Path, prompt_key: str = "prompt", n: int = 1, max_samples: int = -1,
                 image_key: str | None = "images", video_key: str | None = "videos") -> DataProto:
    """Read a dataset file, check every row's prompt and build the rollout batch.

    Anything wrong (missing or unreadable file, no rows, missing prompt column, a prompt that is not
    a list of ``{role, content}`` messages) raises :class:`DatasetError` naming the file and the
    row. verl's multimodal columns (``image_key`` / ``video_key``, ``data.image_key`` /
    ``data.video_key``) are read as verl reads them (:func:`media_columns`).
    """
    rows, lines = _read(Path(path).expanduser())
    if max_samples and max_samples > 0:
        rows = rows[:max_samples]
    rows = [media_columns(r, prompt_key, image_key, video_key) for r in rows]
    validate_rows(rows, prompt_key, source=str(path), lines=lines)
    return _build_batch(rows, prompt_key, n)
