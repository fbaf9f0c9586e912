"""The router's error translation (inline in its slot, the hot path) and the ``server_errors``
context manager kept for other callers agree: same type, text, server index and cause."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from agentloop.routing import AsyncLLMServerManager
from agentloop.routing.server_errors import server_errors
from agentloop.servers.base import ServerDeadError
from agentloop.testing import ScriptedServer


def ray_wrapped(cause: Exception) -> Exception:
    """``cause`` as Ray hands it to an actor's caller (an instance of the cause's class too)."""
    return RayTaskError(
        "generate", f"Traceback\n{type(cause).__name__}: {cause}", cause,
        proctitle="ray::VLLMServer.generate()", pid=1, ip="10.0.0.1",
    ).as_instanceof_cause()


def _shape(error: BaseException) -> tuple:
    # by name: Ray makes a new RayTaskError(...) class per wrapped error
    return (
        type(error).__name__, str(error), getattr(error, "server", None),
        type(error.__cause__).__name__,
    )


def _via_router(raised: Exception) -> BaseException:
    mgr = AsyncLLMServerManager([ScriptedServer([raised])], max_failovers=0)
    with pytest.raises(BaseException) as caught:
        asyncio.run(mgr.generate("r1", prompt_ids=[1], sampling_params={}))
    return caught.value


def _via_context_manager(raised: Exception) -> BaseException:
    with pytest.raises(BaseException) as caught, server_errors(0, "r1"):
        raise raised
    return caught.value


@pytest.mark.parametrize(
    "make",
    [
        lambda: ray_wrapped(ValueError("top_k must be at least 1")),
        lambda: ray_wrapped(ServerDeadError("the engine process died")),
        lambda: ActorDiedError(),
        lambda: ServerDeadError("engine 42 died"),
        lambda: ValueError("plain"),
        lambda: RayTaskError("generate", "a traceback without a cause", None),
    ],
    ids=["task-error", "wrapped-dead", "actor-died", "dead", "plain", "no-cause"],
)
def test_router_and_context_manager_translate_alike(make):
    routed, managed = _via_router(make()), _via_context_manager(make())
    assert _shape(routed) == _shape(managed)


def test_translation_results():
    dead = _via_router(ActorDiedError())
    assert isinstance(dead, ServerDeadError) and dead.server == 0
    assert str(dead).startswith("server 0 died (its actor is gone) while serving request r1: ")
    unwrapped = _via_router(ray_wrapped(ValueError("top_k must be at least 1")))
    assert type(unwrapped) is ValueError and isinstance(unwrapped.__cause__, RayTaskError)
    plain = ValueError("plain")
    assert _via_router(plain) is plain
