"""A server call's errors as the caller sees them: the server's own, out of Ray's wrappers.

:func:`translated` (and the context manager :func:`server_errors` around it) turns what one server
call raised into what the router's caller gets (a dead actor: :class:`ServerDeadError`; an error
the server raised: that error);
:func:`server_cause` unwraps ``RayTaskError`` to the exception the server raised;
:func:`plain_message` strips terminal colour codes and Ray's ``ray::Class.method()`` frame lines
from an error's text.  Used by :class:`agentloop.routing.manager.AsyncLLMServerManager`.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import NoReturn

from ray.exceptions import RayActorError, RayTaskError

from agentloop.errors import first_line
from agentloop.servers.base import ServerDeadError

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_RAY_FRAME = re.compile(r"^ray::\S+\(\).*$")


def server_cause(error: BaseException) -> BaseException:
    """The exception a server raised, out of Ray's wrapper (``RayTaskError.cause``, whose own text
    is the remote traceback under a ``ray::Class.method() (pid=…, ip=…)`` line); ``error`` itself
    when it is not wrapped."""
    while (
        isinstance(error, RayTaskError)
        and isinstance(error.cause, BaseException)
        and error.cause is not error
    ):
        error = error.cause
    return error


def plain_message(message: str) -> str:
    """``message`` without terminal colour codes and without Ray's
    ``ray::Class.method() (pid=…)`` lines."""
    lines = [
        line for line in _ANSI.sub("", message).splitlines() if not _RAY_FRAME.match(line.strip())
    ]
    return "\n".join(lines).strip() or _ANSI.sub("", message).strip()


SERVER_CALL_ERRORS: tuple[type[BaseException], ...] = (RayActorError, ServerDeadError, RayTaskError)
"""What a server call may raise that :func:`translated` turns into the caller's error."""


def translated(error: BaseException, server: int, request_id: str) -> BaseException:
    """What the caller of server ``server`` gets for ``error`` (one of :data:`SERVER_CALL_ERRORS`),
    raised by a call for ``request_id``: a dead actor as a :class:`ServerDeadError` named by the
    router's index ``server``; a ServerDeadError the server raised (its engine died) renamed so;
    any other error the server raised as it raised it (out of Ray's wrapper).  Returns ``error``
    itself when it is to be re-raised as it is; raise anything else ``from error``."""
    if isinstance(error, RayActorError):
        return ServerDeadError(
            f"server {server} died (its actor is gone) while serving "
            f"request {request_id}: "
            f"{plain_message(first_line(error))}",
            server,
        )
    if isinstance(error, ServerDeadError):
        return ServerDeadError(plain_message(str(server_cause(error))), server)
    return server_cause(error)


@contextlib.contextmanager
def server_errors(server: int, request_id: str) -> Iterator[None]:
    """Translate what a call to server ``server`` for ``request_id`` raises (:func:`translated`).

    Raises:
        ServerDeadError: the server's actor is gone, or the server itself raised it (its engine
            died); named by the router's index ``server``.
        Exception: any other error the server raised, as it raised it (not Ray's wrapper).
    """
    try:
        yield
    except SERVER_CALL_ERRORS as e:
        reraise_translated(e, server, request_id)


def reraise_translated(error: BaseException, server: int, request_id: str) -> NoReturn:
    """Raise what a call to server ``server`` for ``request_id`` raised, translated
    (:func:`translated`): the error itself, or its translation chained to it."""
    raised = translated(error, server, request_id)
    if raised is error:
        raise error
    raise raised from error
