"""One registration pattern for every extension kind: a :class:`Registry` of name -> object.

Agent loops, agent runners, tool parsers, tools and interactions each keep one ``Registry``, filled
in code by a decorator (``@register(name)``, ``@register_agent_runner(name)``,
``@ToolParser.register(name)``, ``@register_tool(name)``, ``@register_interaction(name)``) and in
YAML by entries of the form ``{name: ..., _target_: pkg.module.Obj, **kwargs}`` (verl's
``class_name`` is an alias of ``_target_``). A ``_target_`` is a registered name or an import path.
Guide: docs/concepts.md#extending-agentloop.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from agentloop.errors import ConfigError
from agentloop.utils.imports import import_object, import_subclass

__all__ = ["Entry", "Registry", "did_you_mean", "entry_target", "target_of"]

TARGET_KEYS = ("_target_", "class_name")
"""Keys naming an entry's object in YAML; ``class_name`` is verl's spelling for tools and
interactions."""


@dataclass(frozen=True)
class Entry:
    """One registration: ``target`` is the object's import path; ``obj`` is the object itself when
    it was registered in code (None: imported from ``target`` on first use); ``kwargs`` are extra
    values the kind passes on (an agent loop's constructor kwargs)."""

    name: str
    target: str
    obj: Any = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)


def target_of(obj: Any) -> str:
    """The import path ``module.qualname`` of a class or function (of its class for other
    objects)."""
    named = obj if hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(named, '__module__', None) or '?'}.{named.__qualname__}"


def did_you_mean(name: str, known: Iterator[str] | list[str]) -> str:
    """``"did you mean 'x'? "`` for the closest known name, or "" when none is close."""
    close = difflib.get_close_matches(str(name), list(known), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def entry_target(entry: Mapping[str, Any], where: str, missing: str) -> str:
    """The ``_target_`` (or its alias ``class_name``) of a YAML entry.

    Raises:
        ConfigError: ``f"{where}: {missing}"`` when neither key is there; naming both keys when they
            disagree.
    """
    given = {key: entry[key] for key in TARGET_KEYS if entry.get(key) is not None}
    if not given:
        raise ConfigError(f"{where}: {missing}")
    if len({str(v) for v in given.values()}) > 1:
        raise ConfigError(f"{where}: '_target_' {given['_target_']!r} and its alias 'class_name' "
                          f"{given['class_name']!r} disagree; give one of them")
    return str(next(iter(given.values())))


class Registry(MutableMapping[str, Any]):
    """name -> registered object of one kind (a class or a callable), readable as a mapping.

    Args:
        kind: what is registered, for messages ("agent loop", "tool parser").
        decorator: the decorator's spelling, for messages ("register", "ToolParser.register").
        how: how a user registers one (ends the unknown-name error).
        base: a class every registered object must subclass (None: any object).
        expected: what the decorator must decorate, for messages ("an AgentLoopBase subclass").
        check: a test every object must pass besides ``base`` (default: none).
        where: the config key that names objects of this kind, for messages (optional).
        fallback: a registry consulted for names this one lacks (built-ins under user
        registrations).
    """

    def __init__(self, kind: str, *, decorator: str, how: str, base: type | None = None,
                 expected: str = "", check: Callable[[Any], bool] | None = None, where: str = "",
                 fallback: Registry | None = None) -> None:
        self.kind, self.decorator, self.how, self.base = kind, decorator, how, base
        article = "an" if base is not None and base.__name__[:1] in "AEIOU" else "a"
        self.expected = expected or (f"{article} {base.__name__} subclass" if base else "an object")
        self.check, self.where, self.fallback = check, where, fallback
        self._entries: dict[str, Entry] = {}

    # ------------------------------------------------------------------ registering
    def register(self, name: str, **kwargs: Any) -> Callable[[Any], Any]:
        """Decorator registering its target as ``name`` (with ``kwargs``); returns the target
        unchanged."""

        def decorator(obj: Any) -> Any:
            self.add(name, obj, **kwargs)
            return obj

        return decorator

    def add(self, name: str, obj: Any, *, replace: bool = False, **kwargs: Any) -> Entry:
        """Register ``obj`` (an object, or an import path string imported on first use) as ``name``.

        The same object (or one with the same import path: a reloaded module) may register again;
        ``replace=True`` allows any.

        Raises:
            ConfigError: ``obj`` is not what this kind takes, or ``name`` is taken by another
            object.
        """
        if isinstance(obj, str):
            entry = Entry(str(name), obj, None, dict(kwargs))
        else:
            self._check(name, obj)
            entry = Entry(str(name), target_of(obj), obj, dict(kwargs))
        if not replace:
            self.refuse_taken(entry.name, entry.target, entry.obj)
        self._entries[entry.name] = entry
        return entry

    def refuse_taken(self, name: str, target: str, obj: Any = None) -> None:
        """Raise ConfigError if ``name`` is registered here by another object than ``obj`` /
        ``target``.

        The same import path counts as the same object for classes and functions (a module imported
        twice or reloaded, a path entry being filled in), not for other objects (two partials).
        """
        old = self._entries.get(name)
        if old is None or (obj is not None and old.obj is obj):
            return
        same_path = old.target == target and (
            obj is None or old.obj is None or hasattr(obj, "__qualname__")
        )
        if not same_path:
            raise ConfigError(
                f"{self.kind} {name!r} is already registered as {old.target}; refusing to register "
                f"{target} under the same name: choose another name, or unregister the first "
                f"(del REGISTRY[{name!r}]; docs/concepts.md#extending-agentloop)"
            )

    def _check(self, name: str, obj: Any) -> None:
        ok = isinstance(obj, type) and issubclass(obj, self.base) if self.base is not None else True
        if not ok or (self.check is not None and not self.check(obj)):
            raise ConfigError(
                f"@{self.decorator}({name!r}) must decorate {self.expected}, got {obj!r}"
            )

    # ------------------------------------------------------------------ looking up
    def entry(self, name: str) -> Entry:
        """The entry registered as ``name`` (here, else in the fallback).

        Raises:
            ConfigError: no such name; the message lists the known names and says how to register
            one.
        """
        found = self.find(name)
        if found is None:
            raise ConfigError(self.unknown_message(name))
        return found

    def find(self, name: str, local: bool = False) -> Entry | None:
        """The entry registered as ``name`` here, else (unless ``local``) in the fallback; or
        None."""
        found = self._entries.get(name)
        if found is None and self.fallback is not None and not local:
            return self.fallback.find(name)
        return found

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        """The object registered as ``name`` (imported if registered by path), else ``default``."""
        found = self.find(name)
        return default if found is None else self.load(found)

    def load(self, entry: Entry, where: str = "") -> Any:
        """``entry``'s object, importing (and checking) its target if it was registered by path."""
        if entry.obj is not None:
            return entry.obj
        obj = self._import(entry.target, where or f"{self.kind} {entry.name!r} _target_")
        if self._entries.get(entry.name) is entry:  # remember it (an override is left alone)
            self._entries[entry.name] = Entry(entry.name, entry.target, obj, entry.kwargs)
        return obj

    def resolve(self, spec: str, where: str = "", hint: str = "") -> Any:
        """The object for ``spec``: a registered name, else an import path (``pkg.mod.Obj``).

        Args:
            spec: a registered name or an import path.
            where: prefix of import errors (default: the kind and the spec).
            hint: appended to a "not a subclass" error.
        Raises:
            ConfigError: unknown name (did-you-mean, the known names, how to register), or an import
                path that does not import or is not of this kind.
        """
        spec = str(spec)
        found = self.find(spec)
        if found is not None:
            return self.load(found, where)
        if "." not in spec and ":" not in spec:
            raise ConfigError(f"{where + ': ' if where else ''}{self.unknown_message(spec)}")
        return self._import(spec, where or f"{self.kind} {spec!r}", hint)

    def _import(self, path: str, where: str, hint: str = "") -> Any:
        if self.base is not None:
            return import_subclass(path, self.base, where, hint=hint)
        obj = import_object(path, where)
        if self.check is not None and not self.check(obj):
            raise ConfigError(f"{where}: {path!r} is not {self.expected}")
        return obj

    def unknown_message(self, name: str) -> str:
        """The error text for an unknown ``name``: did-you-mean, the known names, how to
        register."""
        where = f" ({self.where})" if self.where else ""
        return (f"unknown {self.kind} {name!r}{where}; {did_you_mean(name, self.names())}"
                f"registered: {self.names()}. {self.how}")

    def names(self) -> list[str]:
        """Every registered name (the fallback's too), sorted."""
        return sorted(self.entries())

    def entries(self, local: bool = False) -> dict[str, Entry]:
        """name -> entry, the fallback's first (unless ``local``) and this registry's over them."""
        below = self.fallback.entries() if self.fallback is not None and not local else {}
        return {**below, **self._entries}

    # ------------------------------------------------------------------ mapping protocol (objects)
    def __getitem__(self, name: str) -> Any:
        found = self.find(name)
        if found is None:
            raise KeyError(name)
        return self.load(found)

    def __setitem__(self, name: str, obj: Any) -> None:
        self.add(name, obj, replace=True)

    def __delitem__(self, name: str) -> None:
        """Unregister ``name`` here (a fallback's registration is left alone: KeyError if only it
        has it)."""
        del self._entries[name]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.find(name) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries())

    def __len__(self) -> int:
        return len(self.entries())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


class EntryDictView(MutableMapping[str, dict[str, Any]]):
    """A registry's own layer (not its fallback) seen as verl's ``_agent_loop_registry``: name ->
    ``{"_target_": path, "_class_": cls, **kwargs}`` (``_class_`` only once the object is known).
    Writes register (replacing) in the registry; a written dict needs ``_target_`` or ``_class_``.
    """

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def __getitem__(self, name: str) -> dict[str, Any]:
        found = self.registry.find(name, local=True)
        if found is None:
            raise KeyError(name)
        head = {"_target_": found.target} if found.obj is None else {"_target_": found.target,
                                                                      "_class_": found.obj}
        return {**head, **found.kwargs}

    def __setitem__(self, name: str, value: Mapping[str, Any]) -> None:
        value = dict(value)
        obj = value.pop("_class_", None)
        target = value.pop("_target_", None)
        if obj is None and target is None:
            raise ConfigError(
                f"registry entry {name!r} needs '_target_' (an import path), got {value!r}"
            )
        self.registry.add(name, obj if obj is not None else str(target), replace=True, **value)

    def __delitem__(self, name: str) -> None:
        del self.registry[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.registry.entries(local=True))

    def __len__(self) -> int:
        return len(self.registry.entries(local=True))

    def __repr__(self) -> str:
        return repr(dict(self.items()))
