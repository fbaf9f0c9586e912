"""A small verifiers (0.4.0) environment, written against its public API (``verifiers.v1``).

Nothing here knows about agentloop. ``SumTaskset`` is the data (addition questions, each with
its answer); ``SumTask.exact_answer`` is its rubric (``@vf.reward``: 1.0 when the last integer of
the reply is the answer); ``ChatHarness`` is the program the model runs in: an in-process chat
loop that sends the task's prompt through the rollout's model endpoint (verifiers' interception,
which forwards to the client's ``base_url``) and stops after ``max_turns`` replies. verifiers
loads this module by its taskset id ``verifiers_env`` (the module's name): the taskset and harness
are the ``Taskset`` / ``Harness`` subclasses in ``__all__``.

Run it through agentloop: ``agentloop rollout --config examples/environments/verifiers.yaml``
(docs/environments.md#verifiers); run the rubric alone: ``score_reply("... 12", "12")``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import Any

import verifiers.v1 as vf
from openai import AsyncOpenAI

__all__ = ["ChatHarness", "SumTaskset", "score_reply"]

_INTEGER = re.compile(r"-?\d+")


def score_reply(reply: str, answer: str) -> float:
    """The rubric: 1.0 when the reply's last integer equals ``answer``, else 0.0."""
    found = _INTEGER.findall(reply or "")
    return 1.0 if found and found[-1] == str(answer).strip() else 0.0


class SumData(vf.TaskData):
    """One question; ``answer`` is the reference the rubric compares with."""

    answer: str


class SumTask(vf.Task[SumData]):
    """An addition question scored on the final reply."""

    @vf.reward
    async def exact_answer(self, trace: vf.Trace) -> float:
        """1.0 when the last integer of the model's last reply is the answer."""
        return score_reply(trace.last_reply, self.data.answer)


class SumConfig(vf.TasksetConfig):
    """``num_tasks`` questions drawn with ``seed``."""

    num_tasks: int = 8
    seed: int = 0


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    """Addition questions ``a + b`` with ``a, b`` in 1..50, reproducible from the seed."""

    def load(self) -> Iterator[SumTask]:
        """Yield ``num_tasks`` tasks."""
        rng = random.Random(self.config.seed)
        for i in range(self.config.num_tasks):
            a, b = rng.randint(1, 50), rng.randint(1, 50)
            data = SumData(idx=i, prompt=f"What is {a} + {b}? Answer with the number.",
                           answer=str(a + b))
            yield SumTask(data, self.config.task)


class ChatHarnessConfig(vf.HarnessConfig):
    """``max_turns``: replies per rollout (after the first the model is asked to check it)."""

    max_turns: int = 1
    max_tokens: int | None = None


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """A tool-less chat loop run in-process: every model call goes to ``endpoint`` with
    ``secret`` (verifiers' interception contract), so the trace records the conversation."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime,
                     endpoint: str, secret: str, mcp_urls: dict[str, str], data: vf.TaskData,
                     **kwargs: Any) -> vf.ProgramResult:
        """Send the prompt, then ``max_turns - 1`` follow-ups; returns a success result."""
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages.extend(m if isinstance(m, dict) else m.model_dump(exclude_none=True)
                            for m in prompt or [])
        extra = {"max_tokens": self.config.max_tokens} if self.config.max_tokens else {}
        async with AsyncOpenAI(base_url=endpoint, api_key=secret) as client:
            for turn in range(self.config.max_turns):
                if turn:
                    messages.append({"role": "user", "content": "Check it; give the number."})
                reply = await client.chat.completions.create(
                    model=ctx.model, messages=messages, **extra
                )
                messages.append({"role": "assistant",
                                 "content": reply.choices[0].message.content or ""})
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")
