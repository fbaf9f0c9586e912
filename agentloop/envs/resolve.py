"""Which environment a sample runs in, and the start-up check of every choice
(docs/environments.md#choosing-the-environment).

A sample names its environment in ``extra_info["env"]``, else in an ``env`` column, else
``actor_rollout_ref.rollout.env.default`` applies. A name is one registered with
:func:`~agentloop.envs.base.register_env`, an entry of ``env.config_path`` or an import path; a
mapping is ``{"name": ..., **config}`` or ``{"_target_": "pkg.Class", **config}``. Every failure is
a one-line :class:`~agentloop.errors.ConfigError` that names the fix.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agentloop.config import EnvConfig
from agentloop.envs.base import ENVS
from agentloop.errors import ConfigError
from agentloop.utils.imports import load_yaml_entries
from agentloop.utils.registry import TARGET_KEYS, did_you_mean, entry_target

ENV_AGENT = "env_agent"
"""The agent loop that runs environments (``agent_name``)."""
_KEY = "actor_rollout_ref.rollout.env"
_HOW = (f"register one with @register_env(name), list it in {_KEY}.config_path, "
        "or give its class as {'_target_': 'pkg.module.Class', ...}")


@dataclass(frozen=True)
class EnvChoice:
    """A resolved environment: ``name`` (for messages and the row's ``env`` field), the
    ``factory`` (a class or callable) and the keyword ``config`` it is called with."""

    name: str
    factory: Callable[..., Any]
    config: dict[str, Any] = field(default_factory=dict)

    def make(self) -> Any:
        """A new environment instance (the factory called with the config)."""
        return self.factory(**self.config)


@functools.lru_cache(maxsize=8)
def named_envs(path: str | None) -> dict[str, tuple[str, dict[str, Any]]]:
    """The ``env.config_path`` entries: name -> (target, config).

    Raises:
        ConfigError: the file is missing, not a YAML list, or an entry lacks ``name`` /
            ``_target_``.
    """
    if not path:
        return {}
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for i, entry in enumerate(load_yaml_entries(path, None, f"{_KEY}.config_path")):
        bad = f"entry {i} must be a mapping with 'name' and '_target_', got {entry!r}"
        if not isinstance(entry, dict) or "name" not in entry:
            raise ConfigError(f"{_KEY}.config_path {path}: {bad}")
        target = entry_target(entry, f"{_KEY}.config_path {path}", bad)
        config = {k: v for k, v in entry.items() if k not in ("name", *TARGET_KEYS)}
        out[str(entry["name"])] = (target, config)
    return out


def env_spec(fields: Mapping[str, Any], default: str | None) -> Any:
    """The environment a sample names: ``extra_info["env"]``, else its ``env`` field, else
    ``default``.

    Raises:
        ConfigError: none of the three is set.
    """
    extra = fields.get("extra_info")
    spec = extra.get("env") if isinstance(extra, Mapping) else None
    if spec is None:
        spec = fields.get("env")
    if spec is None:
        spec = default
    if spec is None:
        raise ConfigError(
            f"the sample names no environment: set extra_info.env or an env column to a "
            f"registered name (registered: {known_names(None)}), or set {_KEY}.default"
        )
    return _plain(spec)


def resolve_env(spec: Any, cfg: EnvConfig) -> EnvChoice:
    """The environment ``spec`` names, its config checked against the factory's signature.

    Raises:
        ConfigError: an unknown name (did-you-mean), an import path that does not import (the
            adapter's message names the extra to install), or a config the factory refuses.
    """
    named = named_envs(cfg.config_path)
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, Mapping):
        raise ConfigError(f"environment spec {spec!r}: expected a name or a mapping with 'name' "
                          f"or '_target_' (docs/environments.md)")
    spec = dict(spec)
    target: str | None = None
    if any(spec.get(k) is not None for k in TARGET_KEYS):
        target = entry_target(spec, "environment", "")
        for key in TARGET_KEYS:
            spec.pop(key, None)
        name = str(spec.pop("name", target))
        config = spec
    else:
        name = str(spec.pop("name", "") or "")
        if not name:
            raise ConfigError(f"environment spec {spec!r} has neither 'name' nor '_target_'")
        target, base = named.get(name, (name, {}))
        config = {**base, **spec}
    factory = _factory(target, name, named)
    return EnvChoice(name, factory, _checked(name, factory, config))


def _factory(target: str, name: str, named: Mapping[str, Any]) -> Callable[..., Any]:
    if ENVS.find(target) is None and "." not in target and ":" not in target:
        raise ConfigError(
            f"unknown environment {name!r} (extra_info.env); "
            f"{did_you_mean(name, known_names(named))}registered: {known_names(named)}. {_HOW}"
        )
    factory = ENVS.resolve(target, f"environment {name!r}")
    if not callable(factory):
        raise ConfigError(f"environment {name!r}: {target!r} is not a class or a factory")
    return factory  # type: ignore[no-any-return]


def _checked(name: str, factory: Callable[..., Any], config: dict[str, Any]) -> dict[str, Any]:
    check = getattr(factory, "check_config", None)
    if callable(check):  # an adapter's own check (its package installed, its options known)
        check(config)
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C factory: nothing to check against
        return config
    try:
        signature.bind(**config)
    except TypeError as e:
        takes = [p for p in signature.parameters if p not in ("self", "args", "kwargs")]
        raise ConfigError(f"environment {name!r}: bad config {config!r} ({e}); it takes "
                          f"{takes} (docs/environments.md)") from None
    return config


def known_names(named: Mapping[str, Any] | None) -> list[str]:
    """Registered environment names and ``env.config_path`` names, sorted."""
    return sorted({*ENVS.names(), *(named or {})})


def check_env_config(cfg: EnvConfig) -> None:
    """The start-up check of the config alone: ``env.config_path`` readable, its entries and
    ``env.default`` resolvable.

    Raises:
        ConfigError: the first failure, in one line.
    """
    for name in named_envs(cfg.config_path):
        resolve_env(name, cfg)
    if cfg.default is not None:
        resolve_env(cfg.default, cfg)


def check_env_samples(rows: Iterable[Mapping[str, Any]], cfg: EnvConfig) -> None:
    """The start-up check of a dataset: every environment its ``env_agent`` rows name resolves
    (each distinct spec once).

    Args:
        rows: the samples' fields (``agent_name``, ``extra_info``, ``env``); rows of other loops
            are skipped.
        cfg: the ``env`` section.
    Raises:
        ConfigError: the first row whose environment does not resolve, naming the row.
    """
    check_env_config(cfg)
    seen: set[str] = set()
    for i, row in enumerate(rows):
        if str(row.get("agent_name")) != ENV_AGENT:
            continue
        spec = env_spec(row, cfg.default)
        key = repr(spec)
        if key in seen:
            continue
        seen.add(key)
        try:
            resolve_env(spec, cfg)
        except ConfigError as e:
            raise ConfigError(f"row {i}: {e}") from None


def batch_rows(non_tensor_batch: Mapping[str, Any], default_agent: str) -> list[dict[str, Any]]:
    """The per-row fields :func:`check_env_samples` reads, from a batch's non-tensor columns."""
    size = len(next(iter(non_tensor_batch.values()), []))
    columns = {k: non_tensor_batch.get(k) for k in ("agent_name", "extra_info", "env")}
    return [
        {"agent_name": default_agent if columns["agent_name"] is None else columns["agent_name"][i],
         **{k: v[i] for k, v in columns.items() if v is not None and k != "agent_name"}}
        for i in range(size)
    ]


def _plain(value: Any) -> Any:
    """numpy containers and scalars (a parquet column) as plain Python values."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
