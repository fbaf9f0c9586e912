"""SkyRL-gym environments under the ``env_agent`` loop, unchanged (docs/environments.md#skyrl-gym).

The environment config ``{"name": "skyrl_gym", "env_id": "gsm8k", "env_config": {...}}`` makes one
:class:`SkyRLGymEnv` per sample (without ``env_id``, each sample's ``env_class`` column names it, as
in SkyRL's own datasets). ``reset`` calls ``skyrl_gym.make(env_id, env_config=env_config,
extras=extras)`` and ``env.init(prompt)``; ``step`` calls ``env.step(turn.text)`` and hands back
its observations, reward and done. ``extras`` are SkyRL's per-row fields: the sample's columns
(``reward_model`` also as SkyRL's ``reward_spec``, ``extra_info``, ``data_source``, ...) over the
config's ``extras``. Needs the ``skyrl-gym`` package (``pip install 'agentloop[envs]'``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentloop.envs.base import AssistantTurn, EnvReset, EnvStep, Message, register_env
from agentloop.errors import ConfigError
from agentloop.utils.registry import did_you_mean

__all__ = ["SkyRLGymEnv", "skyrl_extras"]

INSTALL = "pip install 'agentloop[envs]' (or pip install skyrl-gym)"
"""How to get the package, for the missing-package error."""

_NOT_EXTRAS = frozenset({
    "raw_prompt", "prompt", "multi_modal_data", "agent_name", "env_class", "index",
    "tools_kwargs", "interaction_kwargs", "uid", "trajectory_info",
})
"""Sample fields that are agentloop's or the prompt itself, not SkyRL extras."""


def _skyrl_gym() -> Any:
    """The ``skyrl_gym`` module.

    Raises:
        ConfigError: the package is not installed (the message names the install command).
    """
    try:
        import skyrl_gym  # optional dependency: the envs extra
    except ImportError as e:
        raise ConfigError(
            f"environment 'skyrl_gym' needs the skyrl-gym package, which is not installed "
            f"({e}); install it: {INSTALL}"
        ) from e
    return skyrl_gym


def skyrl_extras(sample: Mapping[str, Any], extras: Mapping[str, Any] | None = None
                 ) -> dict[str, Any]:
    """SkyRL's ``extras`` for one sample: the config's ``extras`` under the sample's own columns.

    verl's ``reward_model`` column is also given as SkyRL's ``reward_spec`` (the same
    ``{"ground_truth": ...}`` block) unless the sample has a ``reward_spec``; ``extra_info`` is
    ``{}`` when the sample has none (SkyRL's envs read it unconditionally).

    Args:
        sample: the sample's fields as the loop hands them to ``reset``.
        extras: fixed extras from the environment config (the sample's fields win).
    Returns:
        A new dict; the prompt and agentloop's own fields are left out.
    """
    out = dict(extras or {})
    out.update((k, v) for k, v in sample.items() if k not in _NOT_EXTRAS)
    reward_model = sample.get("reward_model")
    if "reward_spec" not in out and isinstance(reward_model, Mapping):
        out["reward_spec"] = dict(reward_model)
    if not isinstance(out.get("extra_info"), Mapping):
        out["extra_info"] = {}
    return out


def _scalars(info: Mapping[str, Any] | None, prefix: str = "") -> dict[str, Any]:
    """The string, number and bool values of ``info`` (keys prefixed), for ``extra_fields``."""
    return {f"{prefix}{k}": v for k, v in (info or {}).items()
            if isinstance(v, (str, int, float, bool))}


def _messages(observations: Any, where: str) -> list[Message]:
    """SkyRL observations (OpenAI chat messages) as a list of message dicts.

    Raises:
        ValueError: an observation is not a message dict with a ``role``.
    """
    out: list[Message] = []
    for i, message in enumerate(observations or []):
        if not isinstance(message, Mapping) or "role" not in message:
            raise ValueError(
                f"{where}: observation {i} is {type(message).__name__} {str(message)[:80]!r}; "
                "SkyRL-gym environments return chat messages ({'role': ..., 'content': ...})"
            )
        out.append(dict(message))
    return out


def _registered(env_id: Any, entry_point: str | None) -> Any:
    """The ``skyrl_gym`` module once ``env_id`` is registered in it (registered from
    ``entry_point`` when given and not yet registered).

    Raises:
        ConfigError: the package is missing, or ``env_id`` is not a registered id.
    """
    gym = _skyrl_gym()
    if entry_point is not None and env_id not in gym.registry:
        gym.register(id=env_id, entry_point=entry_point)
    if env_id not in gym.registry:
        known = sorted(gym.registry)
        raise ConfigError(
            f"skyrl_gym env_id {env_id!r} is not registered with SkyRL-gym; "
            f"{did_you_mean(str(env_id), known)}registered: {known}. Give entry_point "
            "('pkg.module:EnvClass') or import the module that calls skyrl_gym.register"
        )
    return gym


@register_env("skyrl_gym")
class SkyRLGymEnv:
    """One episode of a SkyRL-gym ``BaseTextEnv``, made fresh for each sample.

    Args:
        env_id: the id registered with ``skyrl_gym.register`` (``gsm8k``, ``gsm8k_multi_turn``,
            ``text2sql``, ``search``, ``lcb``, ``aime``, ... or the user's own); None: the
            sample's ``env_class`` (SkyRL's dataset column), checked at ``reset``.
        env_config: SkyRL's ``env_config`` argument (the env's own settings), passed as given.
        extras: fixed SkyRL ``extras`` under each sample's columns (:func:`skyrl_extras`).
        entry_point: ``"pkg.module:EnvClass"``; registers ``env_id`` with SkyRL-gym when it is not
            registered yet (a user's environment without a module that registers it).
    Raises:
        ConfigError: skyrl-gym is not installed, or ``env_id`` is not registered (did-you-mean and
            the registered ids).
    """

    def __init__(self, env_id: str | None = None, env_config: Mapping[str, Any] | None = None,
                 extras: Mapping[str, Any] | None = None, entry_point: str | None = None) -> None:
        gym = _skyrl_gym() if env_id is None else _registered(env_id, entry_point)
        self.env_id = env_id
        self.env_config = dict(env_config or {})
        self.extras = dict(extras or {})
        self._gym = gym
        self.env: Any = None

    def reset(self, sample: dict[str, Any]) -> EnvReset:
        """``skyrl_gym.make(env_id, env_config=, extras=)`` then ``env.init(prompt)``.

        Args:
            sample: the sample's fields; ``raw_prompt`` is the prompt handed to ``init``.
        Returns:
            ``init``'s conversation as the prompt, its metadata (scalars) as ``info``.
        Raises:
            ValueError: the sample has no ``raw_prompt``, or no ``env_class`` when the config has
                no ``env_id``; ConfigError: an ``env_class`` SkyRL-gym does not know. The
                environment's own errors pass through.
        """
        prompt = sample.get("raw_prompt")
        if prompt is None:
            raise ValueError("skyrl_gym: the sample has no raw_prompt (the chat messages to init)")
        if self.env_id is None:
            env_class = sample.get("env_class")
            if env_class is None:
                raise ValueError("skyrl_gym: no env_id in the environment config and no env_class "
                                 "column in the sample; give one of them")
            self.env_id = str(env_class)
            _registered(self.env_id, None)
        self.env = self._gym.make(self.env_id, env_config=self.env_config,
                                  extras=skyrl_extras(sample, self.extras))
        observations, info = self.env.init([dict(m) for m in prompt])
        return EnvReset(messages=_messages(observations, f"skyrl_gym {self.env_id} init"),
                        info=_scalars(info))

    def step(self, turn: AssistantTurn) -> EnvStep:
        """``env.step(turn.text)``: its observations, reward (None counts 0.0) and done.

        ``metadata`` scalars become ``info``; once done, ``env.get_metrics()`` scalars are added as
        ``skyrl_<name>``. SkyRL's ``postprocessed_action`` is not applied: the sampled tokens stay.
        """
        out = self.env.step(turn.text)
        reward = out.get("reward")
        done = bool(out.get("done"))
        info = _scalars(out.get("metadata"))
        if done and hasattr(self.env, "get_metrics"):
            info.update(_scalars(self.env.get_metrics(), "skyrl_"))
        return EnvStep(messages=_messages(out.get("observations"), f"skyrl_gym {self.env_id} step"),
                       reward=0.0 if reward is None else float(reward), done=done, info=info)

    def close(self) -> None:
        """``env.close()`` once the episode's env was made."""
        if self.env is not None:
            self.env.close()

    @classmethod
    def check_config(cls, config: Mapping[str, Any]) -> None:
        """The start-up check (before any engine): skyrl-gym installed, ``env_id`` (when given)
        registered.

        Raises:
            ConfigError: the package is missing, or ``env_id`` is not registered.
        """
        if config.get("env_id") is None:
            _skyrl_gym()
        else:
            _registered(config["env_id"], config.get("entry_point"))

