"""Config key tables (verl's keys and ours, classified) and the start-up check built on them."""

from agentloop.configcheck.check import (
    check_keys,
    check_load_format,
    check_types,
    fill_verl_defaults,
    reset_warnings,
)
from agentloop.configcheck.keys import (
    DATA,
    HONOURED,
    IRRELEVANT,
    MODEL,
    ROLLOUT,
    SUBTREES,
    UNSUPPORTED,
    Key,
)

__all__ = [
    "DATA", "HONOURED", "IRRELEVANT", "MODEL", "ROLLOUT", "SUBTREES", "UNSUPPORTED", "Key",
    "check_keys", "check_load_format", "check_types", "fill_verl_defaults", "reset_warnings",
]
