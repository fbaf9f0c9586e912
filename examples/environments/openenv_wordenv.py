"""A small OpenEnv environment written against openenv's public server API
(docs/environments.md#openenv); it runs in the OpenEnv venv (`make openenv-env`),
not in agentloop's.

The policy is asked to say a word; each turn it says it scores 1.0 and ends the episode, each miss
scores 0.0 and gets "Not quite. Say <word>." until 3 tries are used. The word comes from
`reset(word=...)` (a row's `extra_info.openenv.word`). Serve it with
`.venv-openenv/bin/python -m uvicorn openenv_wordenv:app` (from this directory); the `openenv`
environment of agentloop starts it itself (examples/environments/openenv.yaml).
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

MAX_TRIES = 3


class SayAction(Action):
    """What the policy said."""

    message: str = Field(..., description="the assistant's text")


class SayObservation(Observation):
    """What the policy is told."""

    prompt: str = ""


def said(word: str, message: str) -> bool:
    """The reward rule: the word appears in the message (case-insensitive)."""
    return word.lower() in message.lower()


class WordEnv(Environment):
    """Say the word: reward 1.0 when said, up to MAX_TRIES tries."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.word = "hello"
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> SayObservation:
        self.word = str(kwargs.get("word", "hello"))
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return SayObservation(prompt=f"Say the word '{self.word}'.", done=False, reward=0.0)

    def step(self, action: SayAction, timeout_s: float | None = None,
             **kwargs: Any) -> SayObservation:
        self._state.step_count += 1
        ok = said(self.word, action.message)
        done = ok or self._state.step_count >= MAX_TRIES
        prompt = "Right." if ok else f"Not quite. Say {self.word}."
        return SayObservation(prompt=prompt, done=done, reward=1.0 if ok else 0.0,
                              metadata={"tries": self._state.step_count, "word": self.word})

    @property
    def state(self) -> State:
        return self._state


app = create_app(WordEnv, SayAction, SayObservation, env_name="word", max_concurrent_envs=16)
