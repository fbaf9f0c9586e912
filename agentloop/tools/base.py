"""BaseTool: the life cycle of one tool for one trajectory (verl's interface).

``create`` → ``execute`` (any number of times) → ``calc_reward`` (optional) → ``release``.  The
agent loop always calls ``release``, also when ``execute`` failed or timed out.

Both of verl's ways of calling ``create`` reach the same place:

* ``await tool.create(create_kwargs={"ground_truth": "72"})`` — verl's agent loops (0.6.1 and 0.9.1)
  and ours: the sample's ``tools_kwargs[name]["create_kwargs"]`` nested under ``create_kwargs``;
* ``await tool.create(instance_id, ground_truth="72")`` — verl's SGLang rollout: the same mapping
  spread as keyword arguments, with the request id as the instance id.

:meth:`BaseTool.create_kwargs` merges the two so a subclass reads them one way.  ``execute`` takes
extra keyword arguments (verl 0.9.1 passes ``agent_data=...``); tools ignore what they do not use.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentloop.errors import ConfigError
from agentloop.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from agentloop.utils.ids import fresh_hex


class BaseTool:
    """Base class of tools.

    Args:
        config: the ``config`` mapping of the tool's YAML entry (e.g. ``timeout``).
        tool_schema: the OpenAI function schema the model sees (a dict is validated).  When None,
        the
            subclass's :meth:`get_openai_tool_schema` override supplies it (verl's rule).
    """

    def __init__(
        self, config: Mapping[str, Any] | None,
        tool_schema: OpenAIFunctionToolSchema | Mapping[str, Any] | None = None,
    ) -> None:
        self.config = dict(config or {})
        self.tool_schema: OpenAIFunctionToolSchema = None  # type: ignore[assignment]  # set just below
        if (
            tool_schema is None
            and type(self).get_openai_tool_schema is not BaseTool.get_openai_tool_schema
        ):
            tool_schema = self.get_openai_tool_schema()
        if tool_schema is None:
            raise ConfigError(
                f"{type(self).__name__} has no tool schema: give tool_schema (the YAML "
                f"entry's 'tool_schema:') "
                "or override get_openai_tool_schema()"
            )
        if isinstance(tool_schema, Mapping):
            tool_schema = OpenAIFunctionToolSchema.model_validate(dict(tool_schema))
        self.tool_schema = tool_schema
        self.name: str = tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        """The schema rendered into the prompt."""
        return self.tool_schema

    @staticmethod
    def create_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The sample's create kwargs from either call form (nested ``create_kwargs`` wins on a
        clash)."""
        nested = kwargs.get("create_kwargs") or {}
        flat = {k: v for k, v in kwargs.items() if k != "create_kwargs"}
        return {**flat, **dict(nested)}

    async def create(
        self, instance_id: str | None = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        """Start an instance for one trajectory; ``kwargs``: see :meth:`create_kwargs`."""
        return instance_id or fresh_hex(), ToolResponse()

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
