"""One error hierarchy for agentloop.

Every message says what failed, what was received and how to fix it.
"""

from __future__ import annotations


def first_line(error: BaseException) -> str:
    """The first non-blank line of an error's message (Ray's wrapped errors carry whole tracebacks),
    else its type's name: for one-line log and row messages."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


class AgentLoopError(Exception):
    """Root of all errors raised by agentloop."""


class ConfigError(AgentLoopError, ValueError):
    """A configuration value is missing, has the wrong type, or points at nothing."""


class DatasetError(AgentLoopError, ValueError):
    """The input dataset or batch is missing a column or has a malformed row."""


class UnknownAgentError(AgentLoopError, KeyError):
    """A sample asked for an ``agent_name`` that is not registered."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class PromptTooLongError(AgentLoopError, ValueError):
    """A prompt is longer than ``rollout.prompt_length`` and truncation is disabled."""


class ServerError(AgentLoopError, RuntimeError):
    """An inference server failed to start or to serve a request."""


class RoutingError(AgentLoopError, RuntimeError):
    """The router has no server to send a request to."""
