"""Building one typed config section from the merged omegaconf tree.

Every section dataclass of :mod:`agentloop.config.schema` names the config key of each of its fields
(its ``SECTION`` prefix plus the field name, or a ``key`` in the field's metadata).
:func:`build_section` reads those keys from a trainer-shaped config, checks each value (the start-up
check's own rule where :data:`agentloop.configcheck.check.TYPE_CHECKS` has one, else one derived
from the field's type) and casts it once.  A key the config lacks takes its value from
``agentloop/configs/rollout.yaml``: defaults live there and nowhere else.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Union, cast

from omegaconf import DictConfig, OmegaConf

from agentloop.config.paths import default_config
from agentloop.configcheck.check import TYPE_CHECKS, Check, invalid_values, value_error
from agentloop.errors import ConfigError

_ABSENT = object()


def field_key(cls: type, f: dataclasses.Field[Any]) -> str:
    """The full dotted config key of field ``f`` of section class ``cls``."""
    key = f.metadata.get("key")
    return str(key) if key else f"{cls.SECTION}.{f.name}"  # type: ignore[attr-defined]


def section_keys(cls: type) -> dict[str, str]:
    """Field name -> full config key, for every field of the section class ``cls``."""
    return {f.name: field_key(cls, f) for f in dataclasses.fields(cls)}


@functools.lru_cache(maxsize=1)
def _defaults() -> DictConfig:
    """``configs/rollout.yaml`` with its interpolations resolved (read-only; loaded once)."""
    cfg = default_config()
    OmegaConf.resolve(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg  # type: ignore[return-value]


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def _lookup(root: Any, key: str) -> Any:
    """The value at dotted ``key`` of a DictConfig or nested mapping; ``_ABSENT`` when a part is
    missing."""
    if isinstance(root, DictConfig):
        return _plain(OmegaConf.select(root, key, default=_ABSENT, throw_on_missing=False))
    node = root
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _ABSENT
        node = node[part]
    return _plain(node)


def read_value(root: Any, key: str) -> Any:
    """The value of ``key`` in ``root``, else in ``configs/rollout.yaml``.

    Raises:
        ConfigError: neither has it (a field whose key is missing from the defaults file).
    """
    value = _lookup(root, key) if root is not None else _ABSENT
    if value is _ABSENT:
        value = _lookup(_defaults(), key)
    if value is _ABSENT:
        raise ConfigError(
            f"{key} is missing and agentloop/configs/rollout.yaml has no default for it"
        )
    return value


# --------------------------------------------------------------------------------------------------
# checks derived from a field's type (for keys the start-up check has no rule for)
# --------------------------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_BASE: dict[Any, Check] = {
    int: (_is_int, "an int"),
    float: (_is_num, "a number"),
    bool: (lambda v: isinstance(v, bool), "true or false"),
    str: (lambda v: isinstance(v, str), "a string"),
    dict: (lambda v: isinstance(v, dict), "a mapping"),
    tuple: (
        lambda v: isinstance(v, (list, tuple)) and all(_is_int(x) for x in v),
        "a list of ints",
    ),
}


def _base_of(tp: Any) -> tuple[Any, bool]:
    """``(base type, optional)`` of an annotation such as ``int``, ``float | None``,
    ``dict[str, Any]``."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        base, _ = _base_of(args[0]) if len(args) == 1 else (Any, False)
        return base, True
    if origin is not None:
        return origin, False
    return tp, False


def type_check(tp: Any) -> Check | None:
    """The check a value of annotation ``tp`` must pass (None: anything goes)."""
    base, optional = _base_of(tp)
    check = _BASE.get(base)
    if check is None:
        return None
    if not optional:
        return check
    ok, expected = check
    return (lambda v: v is None or ok(v)), f"null or {expected}"


def _cast(tp: Any, value: Any) -> Any:
    base, _ = _base_of(tp)
    if value is None:
        return None
    if base is float:
        return float(value)
    if base is tuple:
        return tuple(value)
    if base is dict:
        return dict(value)
    return value


@functools.cache
def _hints(cls: Any) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def field_errors(
    cls: type, values: Mapping[str, Any], keys: Mapping[str, str] | None = None
) -> list[str]:
    """The invalid-value entries (see :func:`agentloop.configcheck.check.value_error`) for
    ``values``.

    The start-up check's rule for a key wins over the one derived from the field's type.
    """
    hints = _hints(cls)
    errors: list[str] = []
    for f in dataclasses.fields(cls):
        key = (keys or {}).get(f.name) or field_key(cls, f)
        value = values[f.name]
        shown = list(value) if isinstance(value, tuple) else value
        check = TYPE_CHECKS.get(key) or type_check(hints[f.name])
        if check is not None and not check[0](shown):
            errors.append(value_error(key, shown, check[1]))
    return errors


def _precheck(cls: type, values: Mapping[str, Any]) -> None:
    """Run the section's own value checks (``PRECHECKS``: field name -> a function raising
    ConfigError); they come first so that their long-standing messages win over the generic type
    message."""
    for name, check in getattr(cls, "PRECHECKS", {}).items():
        check(values[name])


def check_fields(obj: Any, keys: Mapping[str, str] | None = None) -> None:
    """Raise a ConfigError when a field of the section ``obj`` is invalid: the section's own message
    (``PRECHECKS``) or the one-line invalid-values message."""
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    _precheck(type(obj), values)
    errors = field_errors(type(obj), values, keys)
    if errors:
        raise invalid_values(errors)


def build_section(cls: type[Any], root: Any, keys: Mapping[str, str] | None = None,
                  adjust: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> Any:
    """Read, check and cast the fields of section class ``cls`` from a trainer-shaped config.

    Args:
        cls: a section dataclass (``SECTION`` prefix; optional ``key`` metadata per field).
        root: the trainer-shaped config (DictConfig or nested mapping); absent keys come from the
        YAML. keys: field name -> config key overrides (e.g. validation sampling reads
        ``val_kwargs.*``). adjust: maps the raw values before they are checked (e.g. resolving a
        null that means "derive it").

    Raises:
        ConfigError: one line naming every invalid value (the start-up check's wording).
    """
    names = {f.name: (keys or {}).get(f.name) or field_key(cls, f) for f in dataclasses.fields(cls)}
    values = {name: read_value(root, key) for name, key in names.items()}
    if adjust is not None:
        values = adjust(values)
    _precheck(cls, values)
    errors = field_errors(cls, values, names)
    if errors:
        raise invalid_values(errors)
    hints = _hints(cast(Hashable, cls))
    return cls(**{name: _cast(hints[name], v) for name, v in values.items()})
