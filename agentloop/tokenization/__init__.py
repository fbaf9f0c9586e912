"""Exact incremental encoding of non-assistant turns, and a checker against full renders."""

from agentloop.tokenization.incremental import (
    TemplateMismatchError,
    check_incremental,
    encode_new_turns,
    turn_separator,
)

__all__ = ["TemplateMismatchError", "check_incremental", "encode_new_turns", "turn_separator"]
