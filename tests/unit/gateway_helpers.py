"""A live gateway on loopback for tests: real uvicorn + FastAPI, a fake engine, the tiny model's
tokenizer."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import threading
from collections.abc import Callable
from typing import Any

import openai
from omegaconf import OmegaConf

from agentloop.gateway.actor import GatewayActor
from agentloop.testing import ScriptedServer
from agentloop.types import TokenOutput

WORDS = ("Luminous.", "Serendipity.", "Ephemeral.", "Whimsical.", "Quietude.")
CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object", "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


def rollout_config(**gateway: Any) -> Any:
    return OmegaConf.create({
        "prompt_length": 512, "response_length": 256, "calculate_log_probs": True,
        "multi_turn": {"format": "hermes"}, "server": {"max_cache_size": 1000},
        "gateway": {"host": "127.0.0.1", "max_body_bytes": 65536, **gateway},
    })


class FakePolicy:
    """Replies like a tool-using model, deciding from the decoded prompt.

    * last turn is a tool response ``N`` → ``The answer is N.``
    * last user turn asks ``What is <expr>?`` → a hermes tool call to the calculator
    * a user turn asking for a word → the next word of :data:`WORDS`
    * anything else → ``OK.``
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.words = itertools.cycle(WORDS)
        self.prompts: list[list[int]] = []

    def __call__(self, prompt_ids: list[int], params: dict[str, Any], request_id: str) -> list[int]:
        self.prompts.append(list(prompt_ids))
        text = self.tokenizer.decode(prompt_ids)
        last = text.rsplit("<|im_start|>", 2)[-2]
        if "<tool_response>" in last:
            value = re.search(r"<tool_response>\n(.*?)\n</tool_response>", last, re.S)
            reply = f"The answer is {value.group(1) if value else '?'}."
        elif (m := re.search(r"What is (.+?)\?", last)) and "user" in last[:8]:
            call = json.dumps({"name": "calculator", "arguments": {"expression": m.group(1)}})
            reply = f"<tool_call>\n{call}\n</tool_call>"
        elif "word" in last:
            reply = next(self.words)
        else:
            reply = "OK."
        return list(self.tokenizer.encode(reply, add_special_tokens=False)) + [
            self.tokenizer.eos_token_id
        ]


class LiveGateway:
    """A GatewayActor (in-process, no Ray) serving HTTP on a background event loop (``processor``:
    the model's processor, for image requests)."""

    def __init__(
        self, tokenizer: Any, server: Any = None, *,
        policy: Callable[..., list[int] | TokenOutput] | None = None, processor: Any = None,
        **gateway: Any,
    ) -> None:
        self.tokenizer = tokenizer
        self.policy = policy or FakePolicy(tokenizer)
        self.server = server or ScriptedServer(self.policy, eos_token_id=tokenizer.eos_token_id)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.actor = GatewayActor.from_slices(
            rollout_config(**gateway), OmegaConf.create({"path": "tiny"}), [self.server],
            tokenizer=tokenizer, processor=processor,
        )
        self.url = self.run(self.actor.start())

    def run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def session(self, **kwargs: Any) -> Any:
        return self.run(self.actor.create_session(**kwargs))

    def finalize(self, session_id: str, longest_only: bool = False) -> dict[str, Any]:
        return self.run(self.actor.finalize(session_id, longest_only))

    def close(self) -> None:
        self.run(self.actor.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def full_render_ids(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    """Ids of the whole conversation rendered at once (what the trajectory must equal)."""
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def client_for(handle: Any) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=handle.base_url, api_key=handle.api_key, max_retries=0, timeout=30
    )


def run_calculator_agent(client: openai.OpenAI, question: str, stream: bool = False) -> list[dict]:
    """Plain OpenAI-SDK agent code: call tools until the model answers."""
    messages: list[dict] = [{"role": "system", "content": "You are a calculator."},
                            {"role": "user", "content": question}]
    for _ in range(4):
        if stream:
            content, calls, finish = "", {}, None
            for chunk in client.chat.completions.create(
                model="m", messages=messages, tools=[CALC_TOOL], stream=True
            ):
                if not chunk.choices:
                    continue
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for tc in delta.tool_calls or []:
                    calls[tc.index] = {
                        "id": tc.id, "type": "function",
                        "function": {"name": tc.function.name, "arguments": tc.function.arguments},
                    }
                finish = chunk.choices[0].finish_reason or finish
            msg = {"role": "assistant", "content": content or None}
            if calls:
                msg["tool_calls"] = [calls[i] for i in sorted(calls)]
        else:
            resp = client.chat.completions.create(model="m", messages=messages, tools=[CALC_TOOL])
            finish = resp.choices[0].finish_reason
            msg = resp.choices[0].message.model_dump(exclude_none=True)
        messages.append(msg)
        if finish != "tool_calls":
            return messages
        for call in msg["tool_calls"]:
            expr = json.loads(call["function"]["arguments"])["expression"]
            messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": str(eval(expr, {}))}
            )  # noqa: S307
    return messages
