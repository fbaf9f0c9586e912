"""A server call's errors as the caller sees them: the server's own, out of Ray's wrappers.

:func:`server_errors` turns what one server call raised into what the router's caller gets (a dead
actor: :class:`ServerDeadError`; an error the server raised: that error);
:func:`server_cause` unwraps ``RayTaskError`` to the exception the server raised;
:func:`plain_message` strips terminal colour codes and Ray's ``ray::Class.method()`` frame lines
from an error's text.  Used by :class:`agentloop.routing.manager.AsyncLLMServerManager`.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

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


@contextlib.contextmanager
def server_errors(server: int, request_id: str) -> Iterator[None]:
    """Translate what a call to server ``server`` for ``request_id`` raises.

    Raises:
        ServerDeadError: the server's actor is gone, or the server itself raised it (its engine
            died); named by the router's index ``server``.
        Exception: any other error the server raised, as it raised it (not Ray's wrapper).
    """
    try:
        yield
    except RayActorError as e:
        raise ServerDeadError(
            f"server {server} died (its actor is gone) while serving "
            f"request {request_id}: "
            f"{plain_message(first_line(e))}",
            server,
        ) from e
    # raised by the server itself (its engine died): name it by our index
    except ServerDeadError as e:
        raise ServerDeadError(plain_message(str(server_cause(e))), server) from e
    # any other error the server raised: its own, not Ray's traceback text
    except RayTaskError as e:
        cause = server_cause(e)
        if cause is e:
            raise
        raise cause from e
