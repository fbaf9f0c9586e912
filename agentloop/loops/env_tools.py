"""Configured tools inside ``env_agent``: MCP servers and ``BaseTool``s next to the environment.

The tools of ``multi_turn.tool_config_path`` / ``function_tool_path`` (verl's tool YAML, ``type:
mcp`` entries included; loaded once per worker) are offered to the policy together with the tools
the environment's ``reset`` returned. The rule, per tool call of an assistant turn:

- a call naming a tool the environment returned from ``reset`` is the environment's: it goes to
  ``env.step`` in ``AssistantTurn.tool_calls`` (the environment claims its names: a configured
  tool of the same name is not offered);
- a call naming a configured tool (not claimed) runs as ``tool_agent`` runs it
  (:class:`~agentloop.loops.tool_calls.ToolRunner`: per-call timeouts, error text to the model,
  ``max_parallel_calls``, ``max_tool_response_length``) and its result is appended as a tool
  message (mask 0); the environment does not see it;
- any other call (an unknown name) goes to the environment, as without configured tools.

Spec: docs/environments.md#configured-tools-mcp-in-env_agent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentloop.config import MultiTurnConfig
from agentloop.loops.tool_calls import ToolRunner, ToolTurnResult
from agentloop.parsers.base import FunctionCall
from agentloop.tools import registry as tool_registry
from agentloop.tools.base import BaseTool
from agentloop.tools.executor import configure_tool_executor


@dataclass
class EnvTools:
    """The configured tools of one worker and how ``env_agent`` routes calls to them."""

    runner: ToolRunner | None = None
    """Runs the configured tools; None when none is configured."""
    schemas: list[dict[str, Any]] = field(default_factory=list)
    """The configured tools' OpenAI function schemas, in their listing order."""

    @classmethod
    def load(cls, mt: MultiTurnConfig, given: list[BaseTool] | None = None) -> EnvTools:
        """The tools ``given`` (the worker's, already loaded) or those ``mt`` names, with a runner
        under ``mt``'s limits.

        Raises:
            ConfigError: a tool config that does not load, or a bad tool timeout.
        """
        if given is not None:
            tools = list(given)
        elif mt.tool_config_path or mt.function_tool_path:
            tools = tool_registry.load_all_tools(tool_config_path=mt.tool_config_path,
                                                 function_tool_path=mt.function_tool_path)
        else:
            tools = []
        if not tools:
            return cls()
        configure_tool_executor(mt.tool_executor, mt.tool_max_workers)
        by_name = {t.name: t for t in tools}
        runner = ToolRunner(
            tools=by_name, max_parallel_calls=mt.max_parallel_calls,
            max_response_length=mt.max_tool_response_length,
            truncate_side=mt.tool_response_truncate_side, timeout=mt.tool_timeout or None,
        )
        # verl's rule: only the keys the schema was given, so the prompt shows the tool as written
        schemas = [t.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for t in tools]
        return cls(runner=runner, schemas=schemas)

    def offered(self, env_tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        """The tools shown to the policy: the environment's, then each configured tool whose name
        the environment does not claim; None when there are none."""
        if not self.schemas:
            return env_tools
        claimed = claimed_names(env_tools)
        ours = [s for s in self.schemas if _schema_name(s) not in claimed]
        return [*(env_tools or []), *ours] or None

    def split(self, calls: list[FunctionCall], claimed: frozenset[str],
              ) -> tuple[list[FunctionCall], list[FunctionCall]]:
        """``calls`` as (run here: they name a configured tool not in ``claimed``, for the
        environment: the rest), each in call order."""
        if self.runner is None:
            return [], list(calls)
        ours: list[FunctionCall] = []
        theirs: list[FunctionCall] = []
        for c in calls:
            mine = c.name in self.runner.tools and c.name not in claimed
            (ours if mine else theirs).append(c)
        return ours, theirs

    async def run(self, calls: list[FunctionCall],
                  tools_kwargs: dict[str, Any] | None) -> ToolTurnResult:
        """One tool message per call, in call order (``ToolRunner.run_turn``: never raises for a
        tool's failure). Only called with calls :meth:`split` gave to this side."""
        assert self.runner is not None
        return await self.runner.run_turn(calls, tools_kwargs)


def claimed_names(env_tools: list[dict[str, Any]] | None) -> frozenset[str]:
    """The function names of the tools an environment returned from ``reset``."""
    return frozenset(n for n in (_schema_name(t) for t in env_tools or []) if n)


def _schema_name(schema: Any) -> str | None:
    """``schema["function"]["name"]`` (or a flat ``schema["name"]``), None when there is none."""
    if not isinstance(schema, dict):
        return None
    function = schema.get("function")
    name = function.get("name") if isinstance(function, dict) else schema.get("name")
    return name if isinstance(name, str) else None
