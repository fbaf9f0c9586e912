"""The start-up config check: unknown keys, unsupported verl features, value types.

:func:`check_config` runs inside :func:`agentloop.config.resolve_config` after the user's config is
merged over the defaults and before anything starts.  It

1. names every key under ``actor_rollout_ref.rollout`` / ``actor_rollout_ref.model`` / ``data`` that
   is neither verl's nor ours, with a did-you-mean suggestion;
2. names every unsupported verl key set to something other than verl's default;
3. checks the types and ranges of the sampling, length and engine keys that would otherwise fail
   late, inside an engine or an actor.

``actor_rollout_ref.rollout.agent.strict_config`` decides what (1) and (2) do:

* ``null`` (the default): (1) raises one :class:`ConfigError` (as verl's Hydra struct configs reject
  an unknown key), (2) is one warning;
* ``true``: both raise;
* ``false``: both are one warning each (for custom loops that read keys of their own outside
  ``rollout.custom``).

Warnings are logged once per process; every message is one line.  (3) always raises.
"""

from __future__ import annotations

import difflib
import json
import logging
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf

from agentloop.configcheck.keys import (
    HONOURED,
    LOGPROBS_MODES,
    SUBTREES,
    UNSUPPORTED,
    Key,
    Table,
    parents,
)
from agentloop.errors import ConfigError

logger = logging.getLogger("agentloop.config")

_WARNED: set[str] = set()
_PARENTS = {sub: parents(table) for sub, table in SUBTREES.items()}
_MISSING = "???"


def reset_warnings() -> None:
    """Forget which warnings were already logged (they are logged once per process); for tests."""
    _WARNED.clear()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


def _show(value: Any, limit: int = 80) -> str:
    text = json.dumps(value) if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _get(tree: Any, path: str) -> Any:
    node = tree
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


# --------------------------------------------------------------------------------------------------
# 1 + 2: walk the merged (unresolved) config against the key tables
# --------------------------------------------------------------------------------------------------
def _walk(node: dict[str, Any], sub: str, table: Table, rel: str, known_extra: set[str],
          unknown: list[str], leaves: list[tuple[str, Any, Key]]) -> None:
    for k, value in node.items():
        name = f"{rel}{k}"
        entry = table.get(name)
        is_parent = name in _PARENTS[sub]
        if entry is not None and (entry.open or not is_parent or not isinstance(value, dict)):
            leaves.append((name, value, entry))
        elif is_parent:
            if isinstance(value, dict):
                _walk(value, sub, table, f"{name}.", known_extra, unknown, leaves)
        elif name in known_extra or any(
            o.startswith(f"{name}.") or name.startswith(f"{o}.") for o in known_extra
        ):
            continue  # a key of our own defaults file that the table does not list (yet)
        else:
            unknown.append(name)


def _suggest(sub: str, name: str) -> str | None:
    """The closest known key: a sibling spelled alike, the same name in another subtree, or any
    key."""
    table = SUBTREES[sub]
    parent, _, leaf = name.rpartition(".")
    siblings = {k[len(parent) + 1:] if parent else k for k in [*table, *_PARENTS[sub]]
                if (k.rpartition(".")[0] == parent)}
    close = difflib.get_close_matches(leaf, sorted(siblings), n=1, cutoff=0.75)
    if close:
        return f"{sub}.{parent + '.' if parent else ''}{close[0]}"
    for other, other_table in SUBTREES.items():
        if other != sub and leaf in other_table:
            return f"{other}.{leaf}"
    close = difflib.get_close_matches(name, sorted(table), n=1, cutoff=0.8)
    return f"{sub}.{close[0]}" if close else None


def _same(value: Any, default: Any) -> bool:
    if isinstance(value, bool) or isinstance(default, bool):
        return type(value) is type(default) and value == default
    if isinstance(value, (int, float)) and isinstance(default, (int, float)):
        return float(value) == float(default)
    if value in (None, {}, []) and default in (None, {}, []):
        return True
    return bool(value == default)


def _is_active(entry: Key, raw: Any, resolved: Any) -> bool:
    if entry.active is not None:
        return entry.active(resolved)
    return not (_same(raw, entry.default) or _same(resolved, entry.default))


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def _ours(defaults: dict[str, Any]) -> dict[str, set[str]]:
    """Every dotted key of our defaults file, per subtree (so a key added there is never
    'unknown')."""
    out: dict[str, set[str]] = {}
    for sub in SUBTREES:
        keys: set[str] = set()

        def collect(node: Any, rel: str, keys: set[str] = keys) -> None:
            if isinstance(node, dict) and node:
                for k, v in node.items():
                    collect(v, f"{rel}{k}.", keys)
            elif rel:
                keys.add(rel[:-1])

        collect(_get(defaults, sub), "")
        out[sub] = keys
    return out


def check_keys(raw: dict[str, Any], resolved: DictConfig, defaults: dict[str, Any]) -> None:
    """Report unknown keys and unsupported non-default values: a ConfigError or a warning each, as
    ``rollout.agent.strict_config`` says (see the module docstring)."""
    ours = _ours(defaults)
    unknown_lines: list[str] = []
    unsupported_lines: list[str] = []
    missing: list[str] = []
    unknown_lines.extend(_misspelt_sections(raw))
    for sub, table in SUBTREES.items():
        node = _get(raw, sub)
        if not isinstance(node, dict):
            continue
        unknown: list[str] = []
        leaves: list[tuple[str, Any, Key]] = []
        _walk(node, sub, table, "", ours[sub], unknown, leaves)
        for name in unknown:
            hint = _suggest(sub, name)
            unknown_lines.append(f"{sub}.{name}" + (f" (did you mean {hint}?)" if hint else ""))
        for name, value, entry in leaves:
            if value == _MISSING:
                if entry.status == HONOURED:
                    missing.append(f"{sub}.{name}")
                continue
            if entry.status != UNSUPPORTED:
                continue
            resolved_value = _plain(OmegaConf.select(resolved, f"{sub}.{name}", default=value))
            if _is_active(entry, value, resolved_value):
                unsupported_lines.append(f"{sub}.{name}={_show(resolved_value)}: {entry.why}")
    if missing:
        raise ConfigError(
            f"{', '.join(missing)} must be set ('???' in verl's config is a mandatory value): "
            "e.g. actor_rollout_ref.rollout.name=vllm"
        )
    strict = OmegaConf.select(resolved, STRICT_KEY, default=None)
    unknown_msg = _unknown_message(unknown_lines) if unknown_lines else None
    unsupported_msg = _unsupported_message(unsupported_lines) if unsupported_lines else None
    errors = [
        m
        for m, fatal in ((unknown_msg, strict is not False), (unsupported_msg, strict is True))
        if m and fatal
    ]
    if errors:
        raise ConfigError(" ".join(errors) + " " + _escape_hatch(strict))
    for message in (unknown_msg, unsupported_msg):
        if message:
            _warn_once(message)


STRICT_KEY = "actor_rollout_ref.rollout.agent.strict_config"

# verl 0.9.1's generated trainer config: its top-level sections and those of actor_rollout_ref (+
# ours)
_ROOT_SECTIONS = {
    "actor_rollout_ref", "data", "critic", "custom_reward_function", "reward_model",
    "sandbox_fusion", "reward", "algorithm", "distillation", "transfer_queue", "trainer",
    "global_profiler", "skip", "ray_kwargs", "output_dir",
}
_ARR_SECTIONS = {"actor", "ref", "rollout", "model", "hybrid_engine", "nccl_timeout"}


def _misspelt_sections(raw: dict[str, Any]) -> list[str]:
    """Sections outside verl's spelled like a checked one (``dat``, ``actor_rollout_ref.rolout``):
    without this their keys would pass unchecked.  Other unknown sections (a trainer's own) are left
    alone."""
    found: list[str] = []
    for prefix, node, known, checked in (
        ("", raw, _ROOT_SECTIONS, ["data", "actor_rollout_ref"]),
        ("actor_rollout_ref.", raw.get("actor_rollout_ref"), _ARR_SECTIONS, ["rollout", "model"]),
    ):
        for key in node if isinstance(node, dict) else ():
            close = difflib.get_close_matches(str(key), checked, n=1, cutoff=0.75)
            if key not in known and close:
                found.append(f"{prefix}{key} (did you mean {prefix}{close[0]}?)")
    return found



def _unknown_message(lines: list[str]) -> str:
    return (
        f"unknown config key{'s' if len(lines) > 1 else ''} (neither verl's nor "
        f"agentloop's): "
        + "; ".join(lines)
        + ". Fix the spelling if it is a typo. Keys your own agent loop reads belong under "
        "actor_rollout_ref.rollout.custom (verl's free-form extension slot, never checked; "
        "`+` prefix on verl's "
        "command line) or in the loop's entry of agent.agent_loop_config_path (passed to "
        "its constructor)."
    )


def _unsupported_message(lines: list[str]) -> str:
    return (
        "verl config keys set to a non-default value that agentloop does not implement "
        "(they have no effect; "
        "see docs/config.md): " + "; ".join(lines) + ". Reset them to verl's default, or "
        "remove them."
    )


def _escape_hatch(strict: Any) -> str:
    if strict is True:
        return (
            f"({STRICT_KEY}=true makes both errors; set it to null to only warn about "
            f"unsupported keys, or to "
            "false to only warn about both.)"
        )
    return f"(To accept them with a warning, set {STRICT_KEY}=false.)"


# --------------------------------------------------------------------------------------------------
# 3: types and ranges
# --------------------------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


Check = tuple[Callable[[Any], bool], str]
_NUM: Check = (_is_num, "a number")
_BOOL: Check = (lambda v: isinstance(v, bool), "true or false")
_OPT_BOOL: Check = (lambda v: v is None or isinstance(v, bool), "null, true or false")
_STR: Check = (lambda v: isinstance(v, str) and v != "", "a non-empty string")
_OPT_STR: Check = (
    lambda v: v is None or (isinstance(v, str) and v != ""),
    "null or a non-empty string",
)
_POS_INT: Check = (lambda v: _is_int(v) and v > 0, "a positive int")
_OPT_POS_INT: Check = (lambda v: v is None or (_is_int(v) and v > 0), "null or a positive int")
_NON_NEG_INT: Check = (lambda v: _is_int(v) and v >= 0, "an int >= 0")
_OPT_NON_NEG_INT: Check = (
    lambda v: v is None or (_is_int(v) and v >= 0),
    "null or an int >= 0 (0 or null: no cap)",
)
_TOP_K: Check = (lambda v: _is_int(v) and v >= -1, "an int >= -1 (-1: off)")
_TEMP: Check = (lambda v: _is_num(v) and v >= 0, "a number >= 0")
_TOP_P: Check = (lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]")
_POS_NUM: Check = (lambda v: _is_num(v) and v > 0, "a number > 0")
_OPT_POS_NUM: Check = (lambda v: v is None or (_is_num(v) and v > 0), "null or a number > 0")
_OPT_NON_NEG_NUM: Check = (
    lambda v: v is None or (_is_num(v) and v >= 0),
    "null or a number >= 0 (0/null: no limit)",
)
_FRACTION: Check = (lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]")
_OPT_UNIT: Check = (
    lambda v: v is None or (_is_num(v) and 0 <= v <= 1),
    "null or a number in [0, 1]",
)
_OPT_SIZES: Check = (
    lambda v: v is None or (isinstance(v, list) and all(_is_int(x) and x > 0 for x in v)),
    "null or a list of positive ints",
)
_MAPPING: Check = (lambda v: isinstance(v, dict), "a mapping")
_OPT_MAPPING: Check = (lambda v: v is None or isinstance(v, dict), "null or a mapping")


def _one_of(*choices: str) -> Check:
    return (lambda v: v in choices, "one of " + ", ".join(choices))


_R = "actor_rollout_ref.rollout."
_M = "actor_rollout_ref.model."
TYPE_CHECKS: dict[str, Check] = {
    **{
        _R + k: c
        for k, c in {
            "temperature": _TEMP,
            "top_p": _TOP_P,
            "top_k": _TOP_K,
            "repetition_penalty": _POS_NUM,
            "do_sample": _BOOL,
            "n": _POS_INT,
            "prompt_length": _POS_INT,
            "response_length": _POS_INT,
            "calculate_log_probs": _BOOL,
            "ignore_eos": _BOOL,
            "seed": (_is_int, "an int"),
            "logprobs_mode": _one_of(*LOGPROBS_MODES),
            "load_format": _STR,
            "scheduling_policy": _one_of("fcfs", "priority"),
            "dtype": _STR,
            "gpu_memory_utilization": _FRACTION,
            "enforce_eager": _BOOL,
            "free_cache_engine": _BOOL,
            "tensor_model_parallel_size": _POS_INT,
            "max_model_len": _OPT_POS_INT,
            "max_num_seqs": _POS_INT,
            "max_num_batched_tokens": _POS_INT,
            "enable_chunked_prefill": _BOOL,
            "enable_prefix_caching": _BOOL,
            "disable_log_stats": _BOOL,
            "normal_priority": _BOOL,
            "gc_freeze": _BOOL,
            "gc_threshold": _OPT_POS_INT,
            "cudagraph_capture_sizes": _OPT_SIZES,
            "engine_kwargs": _MAPPING,
            "engine_kwargs.vllm": _OPT_MAPPING,
            "engine_kwargs.sglang": _OPT_MAPPING,
            "val_kwargs": _MAPPING,
            "val_kwargs.temperature": _TEMP,
            "val_kwargs.top_p": _TOP_P,
            "val_kwargs.top_k": _TOP_K,
            "val_kwargs.do_sample": _BOOL,
            "val_kwargs.n": _POS_INT,
            "multi_turn": _MAPPING,
            "multi_turn.max_assistant_turns": _OPT_NON_NEG_INT,
            "multi_turn.max_user_turns": _OPT_NON_NEG_INT,
            "multi_turn.max_parallel_calls": _POS_INT,
            "multi_turn.max_tool_response_length": _NON_NEG_INT,
            "multi_turn.tool_response_truncate_side": _one_of("left", "right", "middle"),
            "multi_turn.format": _STR,
            "multi_turn.tool_config_path": _OPT_STR,
            "multi_turn.interaction_config_path": _OPT_STR,
            "multi_turn.tool_timeout": _OPT_NON_NEG_NUM,
            "multi_turn.return_messages": _BOOL,
            "multi_turn.tool_executor": _one_of("thread", "process"),
            "multi_turn.tool_max_workers": _POS_INT,
            "multi_turn.context_window": _OPT_POS_INT,
            "multi_turn.max_context_edits": (
                lambda v: v is None or (_is_int(v) and v >= 0),
                "null or an int >= 0",
            ),
            "agent": _MAPPING,
            "agent.num_workers": _POS_INT,
            "agent.default_agent_loop": _STR,
            "agent.agent_loop_config_path": _OPT_STR,
            "agent.sample_timeout": _OPT_POS_NUM,
            "agent.strict_config": _OPT_BOOL,
            "agent.max_failure_fraction": _OPT_UNIT,
            "server": _MAPPING,
            "gateway": _MAPPING,
            "agent.batch_timeout": _OPT_POS_NUM,
            "agent.max_sample_retries": _NON_NEG_INT,
            "agent.stall_timeout": _OPT_POS_NUM,
            "agent.restart_preempted": _BOOL,
            "agent.record_timing": _OPT_BOOL,
            "server.max_failovers": _OPT_NON_NEG_INT,
            "server.restart_dead": _BOOL,
            "server.weight_update_timeout": _OPT_POS_NUM,
            "server.stall_timeout": _OPT_POS_NUM,
            "server.priority": (
                lambda v: v in (None, "fcfs", "context"),
                "null (first come, first served) or context",
            ),
            "server.placement_strategy": _one_of("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
            "server.weight_update": (
                lambda v: v in (None, "abort", "drain", "keep"),
                "null, abort, drain or keep",
            ),
            "trace.backend": (
                lambda v: v in (None, "jsonl", "mlflow"),
                "null, jsonl or mlflow (verl's weave / trackio backends are not available here)",
            ),
            "trace.max_samples_per_step_per_worker": _OPT_POS_INT,
        }.items()
    },
    _M + "path": _STR,
    _M + "tokenizer_path": _OPT_STR,
    _M + "custom_chat_template": _OPT_STR,
    _M + "trust_remote_code": _BOOL,
}

_EXAMPLES = {
    "temperature": "1.0", "top_p": "1.0", "top_k": "-1", "n": "1",
    "logprobs_mode": "processed_logprobs",
}


def _present(cfg: DictConfig, key: str) -> bool:
    """``key`` exists and is not ``???``."""
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent, throw_on_missing=False) if parent else cfg
    return isinstance(node, DictConfig) and leaf in node and not OmegaConf.is_missing(node, leaf)


def value_error(key: str, value: Any, expected: str) -> str:
    """One entry of the invalid-values message: ``key=value (type): expected ...``."""
    leaf = key.rpartition(".")[2]
    example = f" (e.g. {key}={_EXAMPLES[leaf]})" if leaf in _EXAMPLES else ""
    return f"{key}={_show(value)} ({type(value).__name__}): expected {expected}{example}"


def invalid_values(errors: list[str]) -> ConfigError:
    """The one-line ConfigError naming every invalid value (entries from :func:`value_error`)."""
    return ConfigError("invalid config values: " + "; ".join(errors)
                       + ". Fix them in your config file or with key=value overrides.")


def check_types(resolved: DictConfig) -> None:
    """Raise one ConfigError naming every key whose value has the wrong type or range."""
    errors: list[str] = []
    for key, (ok, expected) in TYPE_CHECKS.items():
        if not _present(resolved, key):
            continue  # absent keys take their defaults downstream; '???' is reported by check_keys
        node = OmegaConf.select(resolved, key)
        value = _plain(node)
        if not ok(value):
            errors.append(value_error(key, value, expected))
    if errors:
        raise invalid_values(errors)


def check_load_format(resolved: DictConfig) -> None:
    """``load_format=dummy`` gives random weights: say so once (verl's default, where its trainer
    syncs real weights right after start-up)."""
    if OmegaConf.select(resolved, _R + "load_format", default="auto") == "dummy":
        _warn_once(
            "actor_rollout_ref.rollout.load_format=dummy: servers start with RANDOM "
            "weights, so generations are "
            "meaningless until update_weights(...) loads real ones (as verl's trainer does). "
            "Set actor_rollout_ref.rollout.load_format=auto to load model.path."
        )


def fill_verl_defaults(root: DictConfig) -> None:
    """Give every verl key the config lacks verl's default (in place), so a verl loop that reads
    ``self.rollout_config.full_determinism`` or ``self.config.data.return_raw_chat`` finds verl's
    value.

    Only absent keys are filled, after the checks ran (the user's and agentloop's values stay).
    verl's ``_target_`` markers and ``???`` (required) values are skipped; an interpolation that
    does not resolve here (it points at a trainer section we do not have) becomes None.
    """
    for subtree, table in SUBTREES.items():
        node = OmegaConf.select(root, subtree)
        if node is None:
            continue
        for rel, entry in table.items():
            if entry.origin == "agentloop" or rel.endswith("_target_") or entry.default == "???":
                continue
            if OmegaConf.select(node, rel, default=_ABSENT) is not _ABSENT:
                continue
            value = entry.default
            if isinstance(value, str) and "${" in value:
                try:
                    # resolved against the root
                    value = OmegaConf.create({"v": value, **_plain(root)}).v
                # a reference to a section agentloop has no use for
                except Exception:  # noqa: BLE001
                    value = None
            OmegaConf.update(node, rel, value, force_add=True)


_ABSENT = object()
