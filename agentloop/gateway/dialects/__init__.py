"""The gateway's wire formats (dialects), by name; the app serves each on
``POST /sessions/{id}/v1{path}``.

Adding a dialect is one import line and one entry in :data:`DIALECTS`.  A dialect module must not
import :mod:`agentloop.gateway.service` or :mod:`agentloop.gateway.app` (they import this package).
Spec: docs/gateway.md#dialects.
"""

from __future__ import annotations

import re

from agentloop.gateway.dialects.base import Dialect
from agentloop.gateway.dialects.chat import CHAT
from agentloop.gateway.dialects.messages import DIALECT as MESSAGES
from agentloop.gateway.dialects.responses import DIALECT as RESPONSES

DIALECTS: dict[str, Dialect] = {
    CHAT.name: CHAT, RESPONSES.name: RESPONSES, MESSAGES.name: MESSAGES,
}
"""Every served dialect, by name."""

_SESSION_ROUTE = re.compile(r"^/sessions/[^/]+/v1(?:/v1)?(?P<rest>/.*)$")


def dialect_for_path(path: str) -> Dialect | None:
    """The dialect whose session route ``path`` is (its ``count_tokens`` route and the ``/v1/v1``
    alias included), e.g. ``/sessions/s1/v1/messages`` -> the Messages dialect; None for any other
    path.
    """
    match = _SESSION_ROUTE.match(path)
    if match is None:
        return None
    rest = match.group("rest").rstrip("/")
    for dialect in DIALECTS.values():
        if rest in (dialect.path, f"{dialect.path}/count_tokens"):
            return dialect
    return None


__all__ = ["DIALECTS", "Dialect", "dialect_for_path"]
