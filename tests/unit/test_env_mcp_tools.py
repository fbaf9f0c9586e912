"""Configured tools inside env_agent: the MCP server of test_tools_mcp.py (FastMCP over stdio)
next to an environment's own tool, on the scripted engine (issue 31). Calls naming a configured
tool run as tool_agent runs them (tool message, mask 0, timeouts as error text); calls naming the
environment's tools go to ``step``; the environment's names win."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf
from test_tools_mcp import SERVER, stdio_entry, write_tools

from agentloop.config import default_config
from agentloop.envs import AssistantTurn, EnvReset, EnvStep, register_env
from agentloop.loops.env_agent import EnvAgentLoop
from agentloop.loops.prompt import apply_chat_template
from agentloop.report.template_check import check_trajectory
from agentloop.routing import AsyncLLMServerManager
from agentloop.testing import ScriptedServer
from agentloop.testing.templates import STOP_TOKENS, make_template_tokenizer

pytest.importorskip("mcp")

STEPS: list[AssistantTurn] = []
SUBMIT = {"type": "function", "function": {
    "name": "submit", "description": "Submit the answer.",
    "parameters": {"type": "object", "properties": {"answer": {"type": "integer"}}}}}
OWN_ADD = {"type": "function", "function": {
    "name": "add", "description": "The environment's own adder (answers 'env says N').",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                     "b": {"type": "integer"}}}}}


class Quiz:
    """'What is 2 + 3?'; its own tool ``submit`` (and ``add`` when ``own_add``): a right submit
    ends it with reward 1, a wrong one gets a tool message 'wrong' and -0.5."""

    def __init__(self, own_add: bool = False) -> None:
        self.own_add = own_add

    def reset(self, sample: dict[str, Any]) -> EnvReset:
        tools = [SUBMIT, OWN_ADD] if self.own_add else [SUBMIT]
        return EnvReset([{"role": "user", "content": "What is 2 + 3?"}], tools=tools)

    def step(self, turn: AssistantTurn) -> EnvStep:
        STEPS.append(turn)
        replies = []
        for call in turn.tool_calls:
            if call["name"] == "submit" and call["arguments"].get("answer") == 5:
                return EnvStep([], reward=1.0, done=True)
            text = "wrong"
            if call["name"] == "add":
                text = f"env says {call['arguments']['a'] + call['arguments']['b']}"
            replies.append({"role": "tool", "content": text, "tool_call_id": call["id"]})
        return EnvStep(replies or [{"role": "user", "content": "Use submit."}], reward=-0.5)


register_env("test_quiz")(Quiz)
NAME = "chatml_hermes"
TOK = copy.deepcopy(make_template_tokenizer(NAME))
END = TOK.convert_tokens_to_ids(STOP_TOKENS[NAME][0])


@pytest.fixture(autouse=True)
def _clean():
    STEPS.clear()
    yield
    EnvAgentLoop.init_class(default_config(), TOK)  # no configured tools for later tests


@pytest.fixture(scope="module")
def tools_yaml(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("env_mcp")
    server_py = directory / "probe_server.py"
    server_py.write_text(SERVER)
    return write_tools(Path(directory), stdio_entry(str(server_py), timeout=1))


def call(name: str, **args: Any) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def say(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False) + [END]


def run_quiz(tools_yaml: str, turns: list[str], own_add: bool = False) -> tuple[Any, Any]:
    cfg = OmegaConf.merge(default_config(), {
        "data": {"max_prompt_length": 1024, "max_response_length": 1024},
        "actor_rollout_ref": {"rollout": {"multi_turn": {
            "tool_config_path": tools_yaml, "return_messages": True}}}})
    OmegaConf.resolve(cfg)
    rollout = cfg.actor_rollout_ref.rollout
    replies = iter([say(t) for t in turns])
    server = ScriptedServer(lambda ids, p, rid: next(replies), eos_token_id=END)

    async def go() -> Any:
        EnvAgentLoop.init_class(rollout, TOK)
        runner = EnvAgentLoop.env_tools.runner
        assert runner is not None
        await runner.tools["pid"].server.connection()  # started before the 1 s timeouts count
        loop = EnvAgentLoop(rollout, AsyncLLMServerManager([server]), TOK)
        env = {"name": "test_quiz", "own_add": own_add}
        return await loop.run({"logprobs": True}, raw_prompt=[], extra_info={"env": env})

    return asyncio.run(go()), server


def offered(server: Any) -> list[str]:
    """The tool names the first prompt's system block shows, in order."""
    text = TOK.decode(server.calls[0]["prompt_ids"])
    names = []
    for line in text.split("<tools>\n")[1].split("\n</tools>")[0].splitlines():
        names.append(json.loads(line)["function"]["name"])
    return names


def test_mcp_calls_run_as_tool_messages_and_env_calls_go_to_step(tools_yaml):
    turns = [call("sleep", seconds=30) + "\n" + call("submit", answer=4),  # mixed
             call("add", a=2, b=3),  # MCP only: the environment is not stepped
             call("submit", answer=5)]
    out, server = run_quiz(tools_yaml, turns)
    assert out.status == "stop" and out.error is None
    assert offered(server) == ["submit", "add", "pid", "sleep", "crash"]
    # the environment saw turns 1 and 3, each with only its own call
    assert [[c["name"] for c in t.tool_calls] for t in STEPS] == [["submit"], ["submit"]]
    assert out.extra_fields["turn_scores"] == [-0.5, 1.0] and out.reward_score == 0.5
    fields = out.extra_fields
    assert (fields["num_tool_calls"], fields["num_tool_errors"], fields["num_tool_timeouts"]) == (
        4, 1, 1)
    tool_texts = [m["content"] for m in fields["messages"] if m["role"] == "tool"]
    assert tool_texts == ["Error: tool 'sleep' timed out after 1s", "wrong", "5"]
    # exact tokens: the first prompt is the template's render with every offered tool, and each
    # mask-0 run (tool turns) is the template's render of the conversation (agentloop verify's
    # check)
    messages = fields["messages"]
    assert out.prompt_ids == apply_chat_template(
        TOK, messages[:1], tools=[SUBMIT, *EnvAgentLoop.env_tools.schemas],
        add_generation_prompt=True)
    checked, problem = check_trajectory(TOK, 0, messages[:1], messages,
                                        np.array(out.response_ids), np.array(out.response_mask))
    assert problem is None and checked == 2  # turn 1's two tool messages are one run
    mask = np.array(out.response_mask)
    sampled = sum(len(say(t)) for t in turns)
    assert mask.sum() == sampled and (mask == 0).sum() == len(out.response_ids) - sampled


def test_the_environment_claims_its_tool_names(tools_yaml):
    out, server = run_quiz(tools_yaml, [call("add", a=2, b=3), call("submit", answer=5)],
                           own_add=True)
    assert offered(server) == ["submit", "add", "pid", "sleep", "crash"]  # one 'add': the env's
    assert [c["name"] for c in STEPS[0].tool_calls] == ["add"]
    tool_texts = [m["content"] for m in out.extra_fields["messages"] if m["role"] == "tool"]
    assert tool_texts == ["env says 5"] and out.extra_fields["num_tool_errors"] == 0


def test_without_configured_tools_every_call_goes_to_the_environment():
    rollout = default_config().actor_rollout_ref.rollout
    EnvAgentLoop.init_class(rollout, TOK)
    assert EnvAgentLoop.env_tools.runner is None
    assert EnvAgentLoop.env_tools.offered(None) is None
    assert EnvAgentLoop.env_tools.offered([]) == []
