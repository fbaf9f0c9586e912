"""BaseTool: the life cycle of one tool for one trajectory (verl's interface).

``create`` → ``execute`` (any number of times) → ``calc_reward`` (optional) → ``release``.  The agent
loop always calls ``release``, also when ``execute`` failed or timed out.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from agentloop.tools.schemas import OpenAIFunctionToolSchema, ToolResponse


class BaseTool:
    """Base class of tools.

    Args:
        config: the ``config`` mapping of the tool's YAML entry (e.g. ``timeout``).
        tool_schema: the OpenAI function schema the model sees.
    """

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema) -> None:
        self.config = dict(config or {})
        self.tool_schema = tool_schema
        self.name = tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        """The schema rendered into the prompt."""
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        """Start an instance for one trajectory; ``kwargs`` are the sample's ``create_kwargs``."""
        return instance_id or uuid4().hex, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        """Run one call; returns (response, step reward, metrics)."""
        return ToolResponse(text=f"tool {self.name!r} does nothing"), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """Reward of the instance at the end of the trajectory."""
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Free the instance's resources."""
        return None
