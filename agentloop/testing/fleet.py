"""A fake fleet: many virtual servers per Ray actor, and a multi-turn loop that drives them.

For rehearsing the real manager, worker pool, balancer actor and router at hundreds or thousands of
servers without GPUs (``scripts/bench_fleet.py``; numbers in docs/benchmarks.md, "Fleet rehearsal").
One Ray actor per server does not fit (1,024 actor processes need more than 24 GiB), so a few
:class:`FleetServer` actors each stand in for many servers: :func:`virtual_servers` repeats each
actor handle in the server list handed to ``AgentLoopManager(config, servers=ServerGroup(...))``
(the documented injection point for servers started elsewhere).  The balancer, the router's
per-server call batchers and every per-server count see N distinct servers; a server's replies do
not depend on its load (each answer takes ``latency + tokens / token_rate`` seconds), so sharing an
actor changes nothing but where the Python runs.

:class:`FleetAgentLoop` (``fleet_agent``) makes ``turns`` generate calls per trajectory (a fixed
prompt, each reply and a short masked "tool result" appended to the context), and records, in the
worker process, how long each call waited for the balancer (:func:`process_report`).  With
``call_ids`` / ``answer_ids`` a server plays a tool-calling model instead, for ``tool_agent``:
the tool call first, the answer once the context holds the call (:meth:`FleetServer.reply_ids`).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from typing import Any
from uuid import uuid4

import psutil
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from agentloop.loops.base import AgentLoopBase, register
from agentloop.testing.scripted import ScriptedServer, fake_log_probs
from agentloop.types import (
    AgentLoopMetrics,
    AgentLoopOutput,
    RolloutStatus,
    StopReason,
    TokenOutput,
)

_ACQUIRE_S: list[float] = []
"""Seconds each generate call of this process waited for its server (the balancer's answer)."""
_CALL_S: list[float] = []
"""Seconds each generate call of this process took end to end, as the loop saw it."""


class FleetServer(ScriptedServer):
    """A fake server answering every request after ``latency + tokens / token_rate`` seconds.

    Takes VLLMServer's constructor shape too (``sections, server_index``), so it can also be
    registered in ``SERVER_CLASSES``.  Keeps no per-call record (a million calls must not grow it):
    only :attr:`num_calls` and :attr:`num_tokens`.

    Args:
        sections: ignored (VLLMServer's first argument).
        server_index: ignored (VLLMServer's second argument).
        latency: seconds before the first token of every reply.
        token_rate: tokens per second of one reply.
        tokens: tokens per reply (capped by the request's ``max_tokens``).
        token_id: the token every reply repeats.
        call_ids, answer_ids: a tool-calling model's two replies (see :meth:`reply_ids`); None:
            ``tokens`` times ``token_id``.
    """

    def __init__(
        self, sections: Any = None, server_index: int = 0, *, latency: float = 0.0,
        token_rate: float = 0.0, tokens: int = 4, token_id: int = 13,
        call_ids: Sequence[int] | None = None, answer_ids: Sequence[int] | None = None,
    ) -> None:
        super().__init__(name=f"fleet{server_index}")
        self.latency = float(latency)
        self.token_rate = float(token_rate)
        self.tokens = int(tokens)
        self.token_id = int(token_id)
        self.call_ids = list(call_ids) if call_ids else None
        self.answer_ids = list(answer_ids or [])
        self.num_calls = 0
        self.num_tokens = 0

    def reply_ids(self, prompt_ids: list[int], max_tokens: int | None) -> list[int]:
        """What a request gets: ``call_ids`` while the context does not hold the call (its
        tokens but the last, in a row) yet, else ``answer_ids`` (stateless, so any server can answer
        any turn); without ``call_ids``, ``tokens`` times ``token_id``; capped by ``max_tokens``."""
        if self.call_ids is None:
            ids = [self.token_id] * self.tokens
        elif _holds(prompt_ids, self.call_ids[:-1]):
            ids = self.answer_ids
        else:
            ids = self.call_ids
        return ids if max_tokens is None else ids[: max(0, int(max_tokens))]
    async def generate(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
        image_data: list[Any] | None = None, **kwargs: Any,
    ) -> TokenOutput:
        """Reply with ``min(tokens, max_tokens)`` tokens after the configured time; held while
        paused (the pause gate of every server)."""
        self.num_calls += 1
        max_tokens = sampling_params.get("max_tokens")
        ids = self.reply_ids(prompt_ids, max_tokens)
        n = len(ids)
        wait = self.latency + (n / self.token_rate if self.token_rate > 0 else 0.0)
        async with self.gate.admitted(request_id) as admitted:
            if admitted and wait > 0:
                await asyncio.sleep(wait)
            if not admitted:
                n = 0
            self.num_tokens += n
            stop = StopReason.LENGTH if max_tokens is not None and n == int(max_tokens) else (
                StopReason.STOP
            )
            if not admitted:
                stop = StopReason.ABORTED
            output = TokenOutput(
                token_ids=ids[:n],
                log_probs=fake_log_probs(n) if sampling_params.get("logprobs") else None,
                stop_reason=stop, extra_fields={"global_steps": self.global_steps},
            )
            update = self.gate.signals(output.stop_reason, request_id, max_tokens)
            return output.model_copy(update=dict(update)) if update else output

    async def start(self) -> dict[str, Any]:
        """Nothing to start."""
        return {"platform": "fleet"}

    def counters(self) -> dict[str, int]:
        """Calls and tokens served so far."""
        return {"calls": self.num_calls, "tokens": self.num_tokens}


def _holds(ids: list[int], run: list[int]) -> bool:
    """Whether ``run`` occurs in ``ids`` as consecutive tokens."""
    if not run:
        return True
    return any(ids[i:i + len(run)] == run for i, token in enumerate(ids) if token == run[0])


def start_fleet_hosts(
    num_hosts: int, node_ids: Sequence[str], **server_kwargs: Any
) -> list[Any]:
    """Start ``num_hosts`` FleetServer actors, host ``i`` pinned to ``node_ids[i % len]``.

    Args:
        num_hosts: how many actor processes.
        node_ids: Ray node ids to spread them over (round-robin).
        **server_kwargs: FleetServer's keywords (``latency``, ``token_rate``, ``tokens``).

    Returns:
        The started actor handles.
    """
    cls: Any = ray.remote(FleetServer)
    hosts = [
        cls.options(
            num_cpus=0, max_concurrency=100000,
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                node_ids[i % len(node_ids)], soft=False
            ),
        ).remote(None, i, **server_kwargs)
        for i in range(num_hosts)
    ]
    ray.get([h.start.remote() for h in hosts])
    return hosts


def virtual_servers(hosts: Sequence[Any], num_servers: int) -> list[Any]:
    """The server list for ``num_servers`` virtual servers: server ``i`` is ``hosts[i % len]``."""
    return [hosts[i % len(hosts)] for i in range(num_servers)]


def process_report(reset: bool = False) -> dict[str, Any]:
    """This process's CPU seconds, resident memory and the loop's latency samples.

    Args:
        reset: clear the latency samples after reading them.

    Returns:
        ``cpu_s`` (user + system), ``rss`` (bytes), ``acquire_s`` and ``call_s`` (lists of seconds).
    """
    proc = psutil.Process(os.getpid())
    times = proc.cpu_times()
    report = {
        "cpu_s": times.user + times.system, "rss": proc.memory_info().rss,
        "acquire_s": list(_ACQUIRE_S), "call_s": list(_CALL_S),
    }
    if reset:
        _ACQUIRE_S.clear()
        _CALL_S.clear()
    return report


def _timed_acquire(router: Any) -> None:
    """Wrap ``router._acquire`` (once per router) so each wait for the balancer is recorded."""
    if getattr(router, "_fleet_timed", False):
        return
    inner = router._acquire

    async def acquire(request_id: str, prompt_len: int, *args: Any, **kwargs: Any) -> int:
        start = time.perf_counter()
        chosen = inner(request_id, prompt_len, *args, **kwargs)  # an index, or an awaitable of one
        server = chosen if isinstance(chosen, int) else await chosen
        _ACQUIRE_S.append(time.perf_counter() - start)
        return server

    router._acquire = acquire
    router._fleet_timed = True


@register("fleet_agent")
class FleetAgentLoop(AgentLoopBase):
    """``turns`` generate calls per trajectory (sample fields ``turns``, ``prompt_len``,
    ``tokens_per_turn``, ``obs_tokens``; defaults 10, 16, 4, 2), one request id for all of them.

    The prompt is ``prompt_len`` fixed ids (no chat template: its cost is bench_stack.py's);
    after each reply but the last, ``obs_tokens`` masked ids stand for a tool result.  The
    response is cut to ``response_length``.
    """

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        _timed_acquire(self.server_manager)
        turns = int(kwargs.get("turns") or 10)
        obs = [7] * int(kwargs.get("obs_tokens") or 2)
        params = {**sampling_params, "max_tokens": int(kwargs.get("tokens_per_turn") or 4)}
        prompt_ids = [5] * int(kwargs.get("prompt_len") or 16)
        response: list[int] = []
        mask: list[int] = []
        request_id = uuid4().hex
        started = time.perf_counter()
        stop = StopReason.STOP
        for turn in range(turns):
            call = time.perf_counter()
            out = await self.server_manager.generate(
                request_id=request_id, prompt_ids=prompt_ids + response, sampling_params=params
            )
            _CALL_S.append(time.perf_counter() - call)
            response += out.token_ids
            mask += [1] * len(out.token_ids)
            stop = out.stop_reason
            if turn + 1 < turns:
                response += obs
                mask += [0] * len(obs)
        cut = len(response) > self.response_length
        status = RolloutStatus.ABORTED if stop == StopReason.ABORTED else RolloutStatus.STOP
        return AgentLoopOutput(
            prompt_ids=prompt_ids, response_ids=response[: self.response_length],
            response_mask=mask[: self.response_length], num_turns=2 * turns,
            metrics=AgentLoopMetrics(generate_sequences=time.perf_counter() - started),
            status=RolloutStatus.LENGTH if cut else status,
        )
