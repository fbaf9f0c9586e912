"""A discrete-event simulation of multi-turn rollout, driving agentloop's real balancer (no Ray, no engine).

Servers batch continuously: a decode step of a server running ``n`` requests takes ``step_a + step_b * n``
seconds (plus ``prefill_per_token`` for each prompt token not in its prefix cache of the requests that joined
since the previous step) and gives every running request one token.  A turn's prompt is cached when the
trajectory's previous turn ran on the same server (its whole context so far), else it is prefilled again.
Trajectories have heavy-tailed numbers of turns, response lengths and tool latencies (lognormal); between turns
a trajectory waits for its tool.  Every turn is routed exactly as the workers route it: ``acquire(request_id,
prompt_len)`` on the balancer when the turn starts, ``release(server)`` when it ends.

:func:`simulate` returns the makespan, its lower bound (the longest trajectory alone on an idle server, or all
the work spread over the servers at full batch, whichever is larger), the prefix-cache hit rate and how evenly
the tokens were spread.  ``python scripts/sim_rollout.py`` prints a table.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Workload:
    """Heavy-tailed multi-turn trajectories (medians and lognormal sigmas)."""

    trajectories: int = 4096
    turns_median: float = 3.0
    turns_sigma: float = 0.8
    max_turns: int = 16
    tokens_median: float = 200.0
    tokens_sigma: float = 1.0
    max_tokens: int = 4096
    tool_median_s: float = 1.0
    tool_sigma: float = 1.0
    prompt_tokens: int = 512
    tool_tokens: int = 64
    seed: int = 0


@dataclass
class ServerModel:
    """Continuous-batching cost model of one server."""

    step_a: float = 0.010
    """Fixed seconds per decode step."""
    step_b: float = 0.0002
    """Extra seconds per running request per step."""
    prefill_per_token: float = 0.00002
    """Seconds per uncached prompt token of a joining request."""
    max_batch: int = 256


@dataclass
class _Trajectory:
    index: int
    turns: list[int]
    tools: list[float]
    turn: int = 0
    context: int = 0
    last_server: int | None = None
    done_at: float = 0.0


@dataclass
class _Server:
    running: dict[int, int] = field(default_factory=dict)  # trajectory -> tokens left in this turn
    waiting: list[tuple[int, int]] = field(default_factory=list)  # (trajectory, uncached prompt tokens)
    busy: bool = False
    tokens: int = 0


def make_trajectories(w: Workload) -> list[_Trajectory]:
    rng = random.Random(w.seed)
    out = []
    for i in range(w.trajectories):
        turns = max(1, min(w.max_turns, round(rng.lognormvariate(math.log(w.turns_median), w.turns_sigma))))
        lengths = [max(1, min(w.max_tokens, round(rng.lognormvariate(math.log(w.tokens_median), w.tokens_sigma))))
                   for _ in range(turns)]
        tools = [rng.lognormvariate(math.log(w.tool_median_s), w.tool_sigma) for _ in range(turns - 1)]
        out.append(_Trajectory(i, lengths, tools, context=w.prompt_tokens))
    return out


def lower_bound(trajs: list[_Trajectory], w: Workload, m: ServerModel, servers: int) -> float:
    """max(longest trajectory alone on an idle server, all tokens at full batch spread over the servers)."""
    alone = max(sum(t.turns) * (m.step_a + m.step_b) + sum(t.tools) for t in trajs)
    tokens = sum(sum(t.turns) for t in trajs)
    per_token_at_full_batch = m.step_b + m.step_a / m.max_batch
    return max(alone, tokens * per_token_at_full_batch / servers)


def simulate(balancer_factory: Callable[[int], Any], w: Workload | None = None, m: ServerModel | None = None,
             servers: int = 8) -> dict[str, float]:
    """Run the workload through ``balancer_factory(servers)`` (e.g. ``agentloop.routing.strategies.make_balancer``;
    anything with ``acquire(request_id, prompt_len)`` and ``release(server)``) and report what happened."""
    w, m = w or Workload(), m or ServerModel()
    balancer = balancer_factory(servers)
    trajs = make_trajectories(w)
    nodes = [_Server() for _ in range(servers)]
    events: list[tuple[float, int, str, int]] = []  # (time, seq, kind, id)
    seq = 0
    hits = misses = 0

    def push(t: float, kind: str, ident: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, ident))

    def start_turn(now: float, traj: _Trajectory) -> None:
        nonlocal hits, misses
        server = balancer.acquire(f"traj-{traj.index}", traj.context)
        cached = traj.last_server == server
        if traj.turn:  # a later turn: its context is cached where its previous turn ran
            hits += cached
            misses += not cached
        uncached = w.tool_tokens if cached and traj.turn else traj.context
        nodes[server].waiting.append((traj.index, uncached))
        if not nodes[server].busy:
            step(now, server)

    def step(now: float, server: int) -> None:
        node = nodes[server]
        prefill = 0
        while node.waiting and len(node.running) < m.max_batch:
            index, uncached = node.waiting.pop(0)
            node.running[index] = trajs[index].turns[trajs[index].turn]
            prefill += uncached
        if not node.running:
            node.busy = False
            return
        node.busy = True
        push(now + m.step_a + m.step_b * len(node.running) + m.prefill_per_token * prefill, "step", server)

    for traj in trajs:
        start_turn(0.0, traj)
    now = 0.0
    while events:
        now, _, kind, ident = heapq.heappop(events)
        if kind == "tool":
            start_turn(now, trajs[ident])
            continue
        node = nodes[ident]
        finished = []
        for index in list(node.running):
            node.running[index] -= 1
            node.tokens += 1
            if node.running[index] == 0:
                finished.append(index)
        for index in finished:
            del node.running[index]
            balancer.release(ident)
            traj = trajs[index]
            traj.context += traj.turns[traj.turn] + w.tool_tokens
            traj.last_server = ident
            if traj.turn + 1 < len(traj.turns):
                push(now + traj.tools[traj.turn], "tool", index)
                traj.turn += 1
            else:
                traj.done_at = now
        step(now, ident)
    bound = lower_bound(trajs, w, m, servers)
    tokens = [n.tokens for n in nodes]
    return {"makespan_s": now, "lower_bound_s": bound, "ratio": now / bound,
            "prefix_hit_rate": hits / max(1, hits + misses),
            "load_imbalance": max(tokens) / (sum(tokens) / len(tokens)) if sum(tokens) else 1.0}
