"""TRL's prompts as an agentloop batch, and an agentloop rollout as TRL's ``rollout_func`` fields.

No TRL import here (:mod:`agentloop.integrations.trl` holds the trainer-facing object). The field
mapping, the multi-trajectory rule and the failure rule are in docs/trl.md.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agentloop.batch.data import rows_to_batch
from agentloop.batch.protocol import DataProto, object_array

FAILED_STATUSES = ("error", "timeout", "aborted")
"""Statuses of rows that failed for reasons outside the policy (an exception, a timeout, an engine
abort); rows whose reward could not be computed (``reward_valid`` 0) count as failed too."""

NAMED_COLUMNS = ("status", "error", "__num_turns__", "trajectory_index", "num_trajectories",
                 "session_id", "uid")
"""Non-tensor columns returned under their own field names (``__num_turns__`` as ``num_turns``)."""


@dataclass
class TRLRollout:
    """One ``rollout_func`` result before it goes to TRL.

    Attributes:
        fields: TRL's dict (``prompt_ids``, ``completion_ids``, ``logprobs``, ``env_mask`` and the
            extra fields), one list entry per prompt.
        failed: failed samples by status (``reward_invalid`` for a row without a valid reward).
    """

    fields: dict[str, Any]
    failed: Counter[str] = field(default_factory=Counter)


def prompt_key(prompt: Any) -> str:
    """A hashable key of a prompt (text or messages) for the dataset look-up."""
    return json.dumps(prompt, sort_keys=True, default=str)


def index_rows(rows: Iterable[Mapping[str, Any]], prompt_column: str = "prompt"
               ) -> dict[str, dict[str, Any]]:
    """Dataset rows by prompt: ``{prompt_key(row[prompt_column]): other columns}``; the first row
    of a repeated prompt wins. Rows without the prompt column are skipped."""
    index: dict[str, dict[str, Any]] = {}
    for row in rows:
        if prompt_column not in row:
            continue
        key = prompt_key(row[prompt_column])
        if key not in index:
            index[key] = {k: v for k, v in row.items() if k != prompt_column}
    return index


def as_messages(prompt: Any) -> list[dict[str, Any]]:
    """A TRL prompt as chat messages: a text prompt becomes one user message; a conversational
    one (a list of ``{role, content}`` dicts) is copied."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def build_batch(prompts: list[Any], *, group_size: int, first_index: int, tag: str,
                fields: Mapping[str, Mapping[str, Any]] | None = None) -> DataProto:
    """The agentloop batch for one process's prompts (TRL already repeats each prompt
    ``group_size`` times, adjacent).

    Args:
        prompts: this process's prompts, text or conversational.
        group_size: TRL's ``num_generations`` (GRPO group size).
        first_index: the global position of ``prompts[0]`` (process index × ``len(prompts)``): the
            ``uid`` of global position ``g`` is ``f"{tag}-{g // group_size}"``, so a group split
            between processes keeps one ``uid``.
        tag: unique per call (the ``uid`` prefix).
        fields: the dataset columns per :func:`prompt_key` (:func:`index_rows`), copied into each
            row (``data_source``, ``reward_model``, ``extra_info``, ``agent_name``...).

    Raises:
        ValueError: ``group_size`` < 1. DatasetError: a malformed prompt.
    """
    if group_size < 1:
        raise ValueError(f"group_size (TRL's num_generations) must be >= 1, got {group_size}")
    rows = []
    for prompt in prompts:
        row = dict((fields or {}).get(prompt_key(prompt), {}))
        row["prompt"] = as_messages(prompt)
        rows.append(row)
    batch = rows_to_batch(rows)  # gives every row a fresh uid: replaced by the groups' own
    batch.non_tensor_batch["uid"] = object_array(
        [f"{tag}-{(first_index + i) // group_size}" for i in range(len(prompts))])
    return batch


def final_rows(out: DataProto, expected: int) -> list[int]:
    """The row of each sample TRL gets: its last trajectory (``trajectory_index ==
    num_trajectories - 1``; every row when the columns are absent).

    Raises:
        ValueError: the rollout does not hold ``expected`` samples.
    """
    nt = out.non_tensor_batch
    if "trajectory_index" in nt and "num_trajectories" in nt:
        last = np.asarray(nt["trajectory_index"], dtype=np.int64) == (
            np.asarray(nt["num_trajectories"], dtype=np.int64) - 1)
        rows = np.flatnonzero(last).tolist()
    else:
        rows = list(range(len(out)))
    if len(rows) != expected:
        raise ValueError(
            f"agentloop returned {len(rows)} samples for {expected} TRL prompts (each sample's "
            "last trajectory is used; see docs/trl.md#multi-trajectory-samples)"
        )
    return rows


def _plain(value: Any) -> Any:
    """numpy scalars → Python values (TRL hands extra fields to user reward functions)."""
    if isinstance(value, np.generic):
        return value.item()
    return value


def _failure(nt: Mapping[str, Any], reward_valid: Any, row: int) -> str | None:
    """Why row ``row`` failed (its status, or ``reward_invalid``), or None."""
    status = str(nt["status"][row]) if "status" in nt else "stop"
    if status in FAILED_STATUSES:
        return status
    if reward_valid is not None and not bool(reward_valid[row]):
        return "reward_invalid"
    return None


def _sequences(out: DataProto, row: int, pad_token_id: int
               ) -> tuple[list[int], list[int], list[int], list[float] | None]:
    """``(prompt_ids, completion_ids, env_mask, logprobs)`` of one row without padding; an empty
    response becomes one ``pad_token_id`` with mask 0 (TRL reads each completion's last token)."""
    b = out.batch
    assert b is not None
    width = b["prompts"].shape[1]
    attention = b["attention_mask"][row].bool()
    prompt = b["prompts"][row][attention[:width]].tolist()
    keep = attention[width:]
    completion = b["responses"][row][keep].tolist()
    mask = b["response_mask"][row][keep].tolist()
    logprobs = None
    if "rollout_log_probs" in set(b.keys()):  # TensorDict: `in` is no key lookup
        logprobs = b["rollout_log_probs"][row][keep].float().tolist()
    if not completion:
        completion, mask, logprobs = [pad_token_id], [0], None if logprobs is None else [0.0]
    return prompt, completion, mask, logprobs


def to_trl_fields(out: DataProto, rows: list[int], *, pad_token_id: int,
                  input_columns: Iterable[str] = (), failed_reward: float | None = None
                  ) -> TRLRollout:
    """TRL's ``rollout_func`` dict from the rows ``rows`` of an agentloop rollout.

    Args:
        out: ``manager.generate_sequences``'s result (verl's layout).
        rows: one row per TRL prompt (:func:`final_rows`).
        pad_token_id: the token of an empty completion.
        input_columns: the batch's own non-tensor columns (left out of ``agentloop_info``).
        failed_reward: the ``reward`` of a failed sample (None: TRL treats the sample as
            unscorable, zero advantage); failed samples always get ``env_mask`` all 0.

    Returns:
        :class:`TRLRollout`: ``prompt_ids``, ``completion_ids`` (the whole response, tool turns
        included), ``logprobs`` (0.0 on tokens the policy did not sample; None without
        ``calculate_log_probs``), ``env_mask`` (1 sampled, 0 tool / observation), ``reward``
        (only with a reward source: ``rm_scores`` summed), ``failed``, ``status``, ``error``,
        ``num_turns``, ``trajectory_index``, ``num_trajectories``, ``session_id``, ``uid``,
        ``agentloop_info`` (the row's other non-tensor columns).
    """
    assert out.batch is not None
    nt, keys = out.non_tensor_batch, set(out.batch.keys())
    reward_valid = out.batch["reward_valid"] if "reward_valid" in keys else None
    scores = out.batch["rm_scores"].float().sum(-1) if "rm_scores" in keys else None
    skip = set(NAMED_COLUMNS) | set(input_columns) | {"raw_prompt"}
    fields: dict[str, list[Any]] = {k: [] for k in (
        "prompt_ids", "completion_ids", "logprobs", "env_mask", "failed", "agentloop_info")}
    fields.update({("num_turns" if c == "__num_turns__" else c): [] for c in NAMED_COLUMNS})
    rewards: list[float | None] = []
    failed: Counter[str] = Counter()
    for r in rows:
        prompt, completion, mask, logprobs = _sequences(out, r, pad_token_id)
        why = _failure(nt, reward_valid, r)
        if why is not None:
            failed[why] += 1
            mask = [0] * len(mask)
        fields["prompt_ids"].append(prompt)
        fields["completion_ids"].append(completion)
        fields["env_mask"].append(mask)
        fields["logprobs"].append(logprobs)
        fields["failed"].append(why is not None)
        if scores is not None:
            rewards.append(failed_reward if why is not None else float(scores[r]))
        for column in NAMED_COLUMNS:
            name = "num_turns" if column == "__num_turns__" else column
            fields[name].append(_plain(nt[column][r]) if column in nt else None)
        fields["agentloop_info"].append(
            {k: _plain(v[r]) for k, v in nt.items() if k not in skip})
    if any(lp is None for lp in fields["logprobs"]):
        fields["logprobs"] = None  # type: ignore[assignment]
    if scores is not None:
        fields["reward"] = rewards
    return TRLRollout(fields=fields, failed=failed)
