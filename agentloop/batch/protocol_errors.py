"""The two DataProto error types, in a module of their own so that every ``protocol_*`` helper
module can raise them without importing another (re-exported from
:mod:`agentloop.batch.protocol_utils` and :mod:`agentloop.batch.protocol`)."""

from __future__ import annotations

from agentloop.errors import DatasetError

__all__ = ["DataProtoError", "DataProtoTypeError"]


class DataProtoError(DatasetError, AssertionError):
    """A DataProto operation got inconsistent input (mismatched sizes, conflicting values, bad
    keys).

    Also an ``AssertionError``: verl raises ``AssertionError`` in these places, so code written
    against verl (``except AssertionError`` / ``pytest.raises(AssertionError)``) keeps working.
    """


class DataProtoTypeError(DatasetError, TypeError):
    """A DataProto operation got an argument of an unsupported type (also a ``TypeError``, as in
    verl)."""
