"""TextArena games as environments (docs/environments.md#textarena).

:class:`TextArenaGame` drives one game made by ``textarena.make(env_id)`` unchanged: ``reset``,
``get_observation``, ``step(action)``, ``close()`` (the game's rewards). Each player's observations
become user turns: by default only what is new since that player's last move, one
``[SENDER] message`` line each (TextArena's LLM observation format, without the player's own move,
which is already its assistant turn); ``observation: wrapped`` hands over the string of the game's
own observation wrappers instead. :class:`TextArenaEnv` (registered as ``textarena``) plays a
one-player game under the ``env_agent`` loop; the ``textarena_selfplay`` loop
(:mod:`agentloop.loops.textarena_selfplay`) plays every seat of a multi-player game from the policy.

TextArena seeds Python's global ``random`` (``random.seed(seed)`` in its state classes); every call
into a game here runs under one process-wide lock with the game's own random state swapped in, so
concurrent games neither disturb each other (a seed gives the same game) nor reseed the rest of the
process. Needs the ``textarena`` package (``pip install 'agentloop[envs]'``).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from agentloop.config import EnvConfig
from agentloop.envs.base import AssistantTurn, EnvReset, EnvStep, Message, register_env
from agentloop.envs.resolve import env_spec, named_envs
from agentloop.errors import AgentLoopError, ConfigError
from agentloop.utils.registry import did_you_mean

__all__ = [
    "TEXTARENA_TARGETS", "GameError", "GameResult", "TextArenaConfig", "TextArenaEnv",
    "TextArenaGame", "check_selfplay_samples", "import_textarena", "prompt_prefix",
    "selfplay_game",
]

INSTALL = "pip install 'agentloop[envs]' (or pip install textarena)"
"""How to get the package, for the missing-package error."""
TEXTARENA_TARGETS = frozenset({"textarena", "agentloop.envs.textarena.TextArenaEnv"})
"""How an environment entry (``_target_``) names :class:`TextArenaEnv`."""
SELFPLAY_LOOP = "textarena_selfplay"
"""The self-play loop's ``agent_name``."""
OBSERVATION_MODES = ("new", "wrapped")
"""``new``: the messages since the player's last move; ``wrapped``: the game wrappers' string."""

_RANDOM_LOCK = threading.Lock()
"""Held around every call into a game: TextArena draws from (and seeds) the global ``random``."""


class GameError(AgentLoopError):
    """A TextArena game raised; the message names the game and the call."""


def import_textarena() -> Any:
    """The ``textarena`` module.

    Raises:
        ConfigError: the package is not installed (the message names the install command).
    """
    try:
        import textarena  # optional dependency: the envs extra
    except ImportError as e:
        raise ConfigError(
            f"environment 'textarena' needs the textarena package, which is not installed ({e}); "
            f"install it: {INSTALL}"
        ) from e
    return textarena


@dataclass(frozen=True)
class TextArenaConfig:
    """One game's settings (the environment config of a sample, or a loop's defaults).

    Attributes:
        env_id: a TextArena id (``GuessTheNumber-v0``, ``TicTacToe-v0``, ``ConnectFour-v0-train``).
        num_players: seats to reset the game with (None: 1 for ``textarena``, 2 for self-play).
        seed: the game's seed (None: a fresh random game).
        observation: ``new`` or ``wrapped`` (module docstring).
        env_kwargs: keyword arguments of ``textarena.make`` (the game's own settings).
    """

    env_id: str
    num_players: int | None = None
    seed: int | None = None
    observation: str = "new"
    env_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], where: str = "textarena env config"
                  ) -> TextArenaConfig:
        """Check and build; ``name``, ``_target_`` and ``class_name`` keys are ignored.

        Raises:
            ConfigError: an unknown key, a missing ``env_id`` or a value of the wrong type.
        """
        given = {k: v for k, v in config.items() if k not in ("name", "_target_", "class_name")}
        known = set(cls.__dataclass_fields__)
        for key in given:
            if key not in known:
                raise ConfigError(f"{where}: unknown key {key!r}; "
                                  f"{did_you_mean(str(key), sorted(known))}keys: {sorted(known)}")
        env_id, players, seed = given.get("env_id"), given.get("num_players"), given.get("seed")
        if not isinstance(env_id, str) or not env_id:
            raise ConfigError(f"{where}: env_id must name a TextArena game (e.g. 'TicTacToe-v0'), "
                              f"got {env_id!r}")
        for key, value in (("num_players", players), ("seed", seed)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"{where}: {key} must be an int or null, got {value!r}")
        if players is not None and players < 1:
            raise ConfigError(f"{where}: num_players must be >= 1, got {players}")
        mode = given.get("observation", "new")
        if mode not in OBSERVATION_MODES:
            modes = " | ".join(OBSERVATION_MODES)
            raise ConfigError(f"{where}: observation must be one of {modes}, got {mode!r}")
        kwargs = given.get("env_kwargs") or {}
        if not isinstance(kwargs, Mapping):
            raise ConfigError(f"{where}: env_kwargs must be a mapping (textarena.make's keyword "
                              f"arguments), got {type(kwargs).__name__}")
        return cls(env_id=env_id, num_players=players, seed=seed, observation=mode,
                   env_kwargs=dict(kwargs))

    def check_registered(self) -> None:
        """Raise a ConfigError (did-you-mean) when TextArena has no game ``env_id``, or when the
        package is missing."""
        registry = import_textarena().envs.registration.ENV_REGISTRY
        if self.env_id not in registry:
            raise ConfigError(
                f"textarena env_id {self.env_id!r} is not a registered TextArena game; "
                f"{did_you_mean(self.env_id, sorted(registry))}see textarena.envs.registration."
                "ENV_REGISTRY for the ids"
            )


@dataclass
class GameResult:
    """How a game ended (``env.close()``)."""

    rewards: dict[int, float] | None
    """Each player's reward; None when the game did not finish (stopped by the loop)."""
    info: dict[int, dict[str, Any]]
    """TextArena's per-player ``game_info`` (``role``, ``invalid_move``, ``turn_count``,
    ``reason``)."""

    def fields(self, player_id: int) -> dict[str, Any]:
        """The player's ``extra_fields``: ``game_done``, ``game_reason``, ``invalid_move``, ``role``
        (strings and numbers)."""
        own = self.info.get(player_id) or {}
        return {
            "game_done": self.rewards is not None,
            "game_reason": str(own.get("reason") or ""),
            "invalid_move": bool(own.get("invalid_move", False)),
            "role": str(own.get("role") or f"Player {player_id}"),
        }


class TextArenaGame:
    """One TextArena game; every call runs under the random lock with the game's own random state.

    Args:
        config: the game to make (``textarena.make(env_id, **env_kwargs)``).
    Raises:
        ConfigError: textarena is missing or ``env_id`` is not one of its games.
    """

    def __init__(self, config: TextArenaConfig) -> None:
        config.check_registered()
        self.config = config
        self._ta = import_textarena()
        self._random = random.Random(config.seed).getstate()
        self.env: Any = None
        self.num_players = 0

    @contextmanager
    def _own_random(self, call: str) -> Iterator[None]:
        """Run a call into the game with its random state; its errors become :class:`GameError`."""
        with _RANDOM_LOCK:
            outer = random.getstate()
            random.setstate(self._random)
            try:
                yield
            except Exception as e:  # noqa: BLE001 - any game failure is reported with its name
                raise GameError(
                    f"textarena game {self.config.env_id!r} failed in {call}: "
                    f"{type(e).__name__}: {e}"
                ) from e
            finally:
                self._random = random.getstate()
                random.setstate(outer)

    def reset(self, num_players: int) -> None:
        """``textarena.make(env_id, **env_kwargs)`` and ``reset(num_players, seed)``.

        Raises:
            GameError: the game raised (e.g. it is not for ``num_players`` players).
        """
        with self._own_random("reset"):
            self.env = self._ta.make(self.config.env_id, **self.config.env_kwargs)
            self.env.reset(num_players=num_players, seed=self.config.seed)
        self.num_players = num_players

    def observe(self) -> tuple[int, str]:
        """The player to move and its observation text (module docstring).

        Raises:
            GameError: the game raised.
        """
        with self._own_random("get_observation"):
            if self.config.observation == "wrapped":
                player_id, observation = self.env.get_observation()
            else:
                player_id, observation = self._base().get_observation()
        text = observation if isinstance(observation, str) else self._format(player_id,
                                                                             observation)
        return int(player_id), text

    def step(self, action: str) -> bool:
        """Play ``action`` (through the game's action wrappers); True when the game is over.

        Raises:
            GameError: the game raised.
        """
        with self._own_random("step"):
            done, _info = self.env.step(action=action)
        return bool(done)

    def result(self) -> GameResult:
        """``env.close()``: the rewards (None while unfinished) and the per-player game info.

        Raises:
            GameError: the game raised.
        """
        with self._own_random("close"):
            closed = self.env.close()
        rewards, info = closed if isinstance(closed, tuple) else (closed, {})
        return GameResult(
            rewards=None if rewards is None else {int(k): float(v) for k, v in rewards.items()},
            info={int(k): dict(v) for k, v in (info or {}).items()},
        )

    def _base(self) -> Any:
        """The game under its wrappers (its raw observations)."""
        env = self.env
        while isinstance(env, self._ta.Wrapper):
            env = env.env
        return env

    def _format(self, player_id: int, messages: list[Any]) -> str:
        """``[SENDER] message`` lines, without the player's own move (it is its assistant turn)."""
        roles = getattr(self._base().state, "role_mapping", {}) or {}
        lines = []
        for sender, message, kind in messages:
            if sender == player_id and kind == self._ta.ObservationType.PLAYER_ACTION:
                continue
            name = "GAME" if sender == self._ta.GAME_ID else roles.get(sender, f"Player {sender}")
            lines.append(f"[{name}] {message}")
        return "\n".join(lines)


def prompt_prefix(sample: Mapping[str, Any]) -> list[Message]:
    """The sample's ``raw_prompt`` messages (e.g. a system message), which start each player's
    conversation before the game's first observation; [] when it has none."""
    raw = sample.get("raw_prompt")
    if raw is None:
        return []
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    items = raw.tolist() if hasattr(raw, "tolist") else list(raw)
    return [dict(m) for m in items]


@register_env("textarena")
class TextArenaEnv:
    """A one-player TextArena game under the ``env_agent`` loop (a new instance per sample).

    Args:
        **config: :class:`TextArenaConfig` keys (``env_id``, ``seed``, ``observation``,
            ``env_kwargs``; ``num_players`` must be 1 or absent).
    Raises:
        ConfigError: a bad config, textarena missing, an unknown game, or ``num_players`` > 1
            (multi-player games run under the ``textarena_selfplay`` loop).
    """

    def __init__(self, **config: Any) -> None:
        self.config = self.check_config(config)
        self.game = TextArenaGame(self.config)

    @classmethod
    def check_config(cls, config: Mapping[str, Any]) -> TextArenaConfig:
        """The start-up check (``agentloop.envs.resolve``): the config, the package, the game id.

        Raises:
            ConfigError: what :class:`TextArenaEnv` refuses, in one line.
        """
        checked = TextArenaConfig.from_dict(config)
        if checked.num_players not in (None, 1):
            raise ConfigError(
                f"textarena env: num_players={checked.num_players}: the env_agent loop plays "
                "one seat; play multi-player games with agent_name textarena_selfplay"
            )
        checked.check_registered()
        return checked

    def reset(self, sample: dict[str, Any]) -> EnvReset:
        """Reset the game for one player; the prompt is the sample's ``raw_prompt`` then the game's
        first observation as a user turn.

        Raises:
            GameError: the game raised (e.g. it needs more players: use ``textarena_selfplay``).
        """
        try:
            self.game.reset(1)
        except GameError as e:
            raise GameError(f"{e} (the textarena env plays one seat: play multi-player games "
                            "with agent_name textarena_selfplay)") from e
        _, text = self.game.observe()
        return EnvReset(messages=[*prompt_prefix(sample), {"role": "user", "content": text}],
                        info={"env_id": self.config.env_id})

    def step(self, turn: AssistantTurn) -> EnvStep:
        """Play the turn's whole text as the move; the next observation, or on the last move the
        game's reward (also ``info["score"]``) and why it ended.

        Raises:
            GameError: the game raised.
        """
        if not self.game.step(turn.text):
            _, text = self.game.observe()
            return EnvStep(messages=[{"role": "user", "content": text}])
        result = self.game.result()
        reward = (result.rewards or {}).get(0, 0.0)
        return EnvStep(messages=[], reward=reward, done=True,
                       info={"score": reward, **result.fields(0)})

    def close(self) -> None:
        """Drop the game (TextArena games hold no outside resources)."""
        self.game.env = None


def selfplay_game(sample: Mapping[str, Any], env: EnvConfig,
                  defaults: Mapping[str, Any] | None = None) -> tuple[str, TextArenaConfig]:
    """A self-play sample's game (:func:`_selfplay_spec`, checked).

    Returns:
        The environment's label (the entry's name, else ``textarena``: the rows' ``env`` field) and
        the game.
    Raises:
        ConfigError: no spec and no defaults, a spec naming another environment, or a bad config.
    """
    label, spec = _selfplay_spec(sample, env, defaults)
    where = f"{SELFPLAY_LOOP} game config (the sample's env over the loop's registry entry)"
    return label, TextArenaConfig.from_dict(spec, where)


def _selfplay_spec(sample: Mapping[str, Any], env: EnvConfig,
                   defaults: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """A self-play sample's game: its environment spec (``extra_info.env``, an ``env`` column or
    ``env.default``, read as ``env_agent`` reads it: the name ``textarena``, an ``env.config_path``
    entry whose ``_target_`` is the textarena env, or a mapping of :class:`TextArenaConfig` keys
    with either) over ``defaults`` (the loop's registry entry); returns its label and the merged
    keys.

    Raises:
        ConfigError: no spec and no defaults, or a spec naming another environment.
    """
    spec = None
    if _names_env(sample, env) or not defaults:
        spec = env_spec(sample, env.default)  # none at all: a ConfigError naming the fix
    given = {"name": spec} if isinstance(spec, str) else dict(spec or {})
    name = given.get("name")
    target = given.get("_target_") or given.get("class_name")
    if target is not None and target not in TEXTARENA_TARGETS:
        raise ConfigError(f"{SELFPLAY_LOOP} plays TextArena games; the sample's environment is "
                          f"{target!r}: give _target_ {sorted(TEXTARENA_TARGETS)[0]!r} or use "
                          "agent_name env_agent")
    named = named_envs(env.config_path)
    if name in named:
        target, base = named[name]
        if target not in TEXTARENA_TARGETS:
            raise ConfigError(f"{SELFPLAY_LOOP} plays TextArena games; environment {name!r} "
                              f"({env.SECTION}.config_path) is {target!r}")
        given = {**base, **given}
    elif name not in (None, "textarena"):
        raise ConfigError(
            f"{SELFPLAY_LOOP} plays TextArena games; the sample names environment {name!r}: "
            f"give {{'name': 'textarena', 'env_id': ...}} or use agent_name env_agent"
        )
    label = name if name in named else "textarena"
    return label, {**(defaults or {}), **given}


def check_selfplay_samples(rows: Iterable[Mapping[str, Any]], env: EnvConfig) -> None:
    """The start-up check of a dataset's ``textarena_selfplay`` rows that name their game (each
    distinct spec once): the config, the package and the game id. Rows that name no environment or
    no ``env_id`` take them from the loop's registry entry and are checked when they run.

    Args:
        rows: the samples' fields (``agent_name``, ``extra_info``, ``env``), e.g.
            ``agentloop.envs.resolve.batch_rows``; rows of other loops are skipped.
        env: the ``env`` section.
    Raises:
        ConfigError: the first row whose game is refused, naming the row.
    """
    seen: set[str] = set()
    for i, row in enumerate(rows):
        if str(row.get("agent_name")) != SELFPLAY_LOOP or not _names_env(row, env):
            continue
        key = repr(env_spec(row, env.default))
        if key in seen:
            continue
        seen.add(key)
        try:
            _, spec = _selfplay_spec(row, env)
            if "env_id" in spec:
                TextArenaConfig.from_dict(spec, f"{SELFPLAY_LOOP} game config").check_registered()
        except ConfigError as e:
            raise ConfigError(f"row {i}: {e}") from None


def _names_env(sample: Mapping[str, Any], env: EnvConfig) -> bool:
    """The sample (or ``env.default``) names an environment."""
    extra = sample.get("extra_info")
    given = extra.get("env") if isinstance(extra, Mapping) else None
    return given is not None or sample.get("env") is not None or env.default is not None
