"""BaseInteraction: a simulated user (or environment) that answers the policy between turns (verl's
API).

Per trajectory: ``start_interaction`` → ``generate_response`` after each assistant turn that made no
tool call → ``calculate_score`` → ``finalize_interaction`` (always called by the loop).

Signatures are verl's (0.6.1 onwards); ``calculate_score`` and ``finalize_interaction`` take the
instance id (our loop passes it; verl's base class declares them without it, so it is optional
here).
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4


class BaseInteraction:
    """Base class; ``config`` is the YAML entry's ``config`` mapping plus its ``name``."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = dict(config or {})
        self.name: str = self.config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Begin one conversation; ``kwargs`` are the sample's ``interaction_kwargs``."""
        return instance_id or uuid4().hex

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """Reply to the conversation so far: (terminate, user message, turn score, extra)."""
        return True, "", 0.0, {}

    async def calculate_score(self, instance_id: str | None = None, **kwargs: Any) -> float:
        """Score of the whole conversation."""
        return 0.0

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs: Any) -> None:
        """Release whatever the conversation holds."""
        return None
