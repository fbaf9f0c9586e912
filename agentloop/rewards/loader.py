"""The ``custom_reward_function`` config block and loading the function it names.

Keys (top level of the trainer config, as in verl)::

    custom_reward_function:
      path: null              # verl: a .py file (``/abs/path.py``, ``file://rel/path.py``) or,
      ours, a module
                              # (``pkg.module``, verl's ``pkg://pkg.module``); null: no custom
                              reward function
      name: compute_score     # verl: the function in that file / module (verl's trainer config has
      null here) reward_kwargs: {}       # verl: extra keyword arguments for every call (they win
      over ours) timeout: 30             # agentloop: seconds per call; null or 0: no limit
      add_tool_rewards: false # agentloop: add the sum of the trajectory's tool step rewards to its
      score

verl 0.9 reads the same block from ``reward.custom_reward_function`` when the top-level one is
unset; so do we.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentloop.config.schema import RewardConfig
from agentloop.errors import ConfigError

_KEY = "custom_reward_function"
_DEFAULT_NAME = "compute_score"

RewardFunctionConfig = RewardConfig
"""``custom_reward_function``, checked: :class:`agentloop.config.RewardConfig` under its older name
(``RewardFunctionConfig.from_config(root)``; fields left out take the YAML's defaults)."""


def load_reward_function(path: str, name: str = _DEFAULT_NAME) -> Callable[..., Any]:
    """The function ``name`` of ``path``: a ``.py`` file (verl's form, ``file://`` allowed) or a
    module (``pkg.module``, ``pkg://pkg.module``; ``pkg.module:attr`` names the function itself).

    Raises:
        ConfigError: the file does not exist or fails to import, the module cannot be imported, or
        it has
            no callable ``name``.
    """
    where = f"{_KEY}.path={path!r}"
    module = _load_file(path, where) if _is_file_path(path) else None
    attr = name
    if module is None:
        module_name = path[len("pkg://"):].replace("/", ".") if path.startswith("pkg://") else path
        module_name, sep, named = module_name.partition(":")
        attr = named if sep else name
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # noqa: BLE001 - any import failure is a config problem, named
            raise ConfigError(
                f"{where}: cannot import module {module_name!r} "
                f"({type(e).__name__}: {e}); give a "
                "path to a .py file or an importable module name"
            ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        found = "not callable" if fn is not None else "not found"
        raise ConfigError(
            f"{where}: {attr!r} {found} in "
            f"{getattr(module, '__file__', module)}; set "
            f"{_KEY}.name to the scoring function, e.g. compute_score"
        )
    return fn  # type: ignore[no-any-return]


def _is_file_path(path: str) -> bool:
    if path.startswith("pkg://"):
        return False
    return path.startswith("file://") or path.endswith(".py") or "/" in path or os.sep in path


def _load_file(path: str, where: str) -> Any:
    file = Path(os.path.expanduser(path[len("file://"):] if path.startswith("file://") else path))
    if not file.is_file():
        raise ConfigError(
            f"{where}: no such file ({file.resolve()}); use an absolute path, "
            f"or a module name "
            "such as agentloop.rewards.gsm8k"
        )
    module_name = "agentloop_reward_" + hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{where}: {file} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses / pickling inside the file need it registered
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file failed to run: say so, with its error
        del sys.modules[module_name]
        raise ConfigError(f"{where}: importing {file} failed: {type(e).__name__}: {e}") from e
    return module
