"""The part of verl's ``verl.utils.tensordict_utils`` that DataProto code uses:
:func:`get_tensordict`."""

from agentloop.batch.protocol_utils import get_tensordict

__all__ = ["get_tensordict"]
