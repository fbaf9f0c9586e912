"""A discrete-event simulation of multi-turn rollout, driving agentloop's real balancer (no Ray, no
engine).

Servers batch continuously (a decode step costs ``step_a + step_b * n``, plus prefill of uncached
prompt tokens); heavy-tailed trajectories (:class:`Workload`) are routed exactly as the workers
route them (``acquire`` / ``release`` on the balancer).  :func:`simulate` runs one synchronous batch
and returns its makespan against a lower bound; :func:`simulate_stream` runs the Rollouter with
partial rollouts and weight updates and returns the steady-state time per batch against the
per-batch work bound. ``python scripts/sim_rollout.py`` prints a table.  Spec (the cost model, both
regimes, the bound): docs/routing.md#simulator.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections.abc import Callable, Iterator
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
    group_size: int = 1
    """GRPO's ``rollout.n``: consecutive trajectories in groups of this many share their prompt."""
    system_tokens: int = 0
    """The first this-many prompt tokens are one system prompt shared by every trajectory."""
    subagents: int = 0
    """Sub-agents each trajectory forks when its first turn ends (synchronous batch only): each
    starts from its parent's context (shared prefix) plus ``tool_tokens`` of instruction and runs
    turns of its own; the batch ends when every parent and sub-agent has ended."""


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
    version: int = 0
    """The weight version when it started (stream regime)."""
    prompt: int = 0
    """Its first prompt's tokens."""
    chain: list[tuple[int, int]] = field(default_factory=list)
    """(key, tokens) of the prefixes its first prompt shares with others, shortest first."""
    children: list[_Trajectory] = field(default_factory=list)
    """Sub-agents started when its first turn ends."""
    is_child: bool = False


@dataclass
class _Server:
    running: dict[int, int] = field(default_factory=dict)  # trajectory -> tokens left in this turn
    # (priority, seq, trajectory, uncached)
    waiting: list[tuple[int, int, int, int]] = field(default_factory=list)
    busy: bool = False
    tokens: int = 0
    stall: float = 0.0  # seconds added to the next step (a weight update's pause and re-prefill)
    cached: dict[int, int] = field(default_factory=dict)  # prefix key -> tokens of it cached


def _trajectory(rng: random.Random, w: Workload, index: int) -> _Trajectory:
    turns = max(
        1, min(w.max_turns, round(rng.lognormvariate(math.log(w.turns_median), w.turns_sigma)))
    )
    lengths = [
        max(
            1,
            min(w.max_tokens, round(rng.lognormvariate(math.log(w.tokens_median), w.tokens_sigma))),
        )
        for _ in range(turns)
    ]
    tools = [rng.lognormvariate(math.log(w.tool_median_s), w.tool_sigma) for _ in range(turns - 1)]
    chain = [(hash((1, 0)), w.system_tokens)] if w.system_tokens else []
    if w.group_size > 1:
        chain.append((hash((2, index // w.group_size)), w.prompt_tokens))
    return _Trajectory(
        index, lengths, tools, context=w.prompt_tokens, prompt=w.prompt_tokens, chain=chain
    )


def traj_key(index: int) -> int:
    """The prefix key of trajectory ``index``'s own context (its sub-agents share it)."""
    return hash((3, index))


def _fork(rng: random.Random, w: Workload, parent: _Trajectory, index: int) -> _Trajectory:
    """A sub-agent of ``parent``: its context after the first turn plus an instruction."""
    child = _trajectory(rng, w, index)
    shared = parent.prompt + parent.turns[0]
    child.prompt = child.context = shared + w.tool_tokens
    child.chain = [*parent.chain, (traj_key(parent.index), shared)]
    child.is_child = True
    return child


def make_trajectories(w: Workload) -> list[_Trajectory]:
    """The workload's trajectories (sub-agents after every parent, each also in its parent's
    ``children``)."""
    rng = random.Random(w.seed)
    trajs = [_trajectory(rng, w, i) for i in range(w.trajectories)]
    for parent in list(trajs[: w.trajectories]):
        for j in range(w.subagents):
            child = _fork(rng, w, parent, w.trajectories + parent.index * w.subagents + j)
            parent.children.append(child)
            trajs.append(child)
    return trajs


def _prefill_s(t: _Trajectory, w: Workload, m: ServerModel) -> float:
    """Prefill every schedule pays for ``t``: its prompt and each tool result, once (a turn landing
    on its previous server reads only the new tokens; any other placement, or an update that empties
    the cache, reads more)."""
    return (t.prompt + w.tool_tokens * (len(t.turns) - 1)) * m.prefill_per_token


def _shared_prefill_s(trajs: list[_Trajectory], m: ServerModel) -> float:
    """Prefill the bound does not count: each shared prefix is read once, not once per trajectory
    (0 for a workload that shares nothing)."""
    saved, seen = 0, set()
    for t in trajs:
        below = 0
        for key, tokens in t.chain:
            if key in seen:
                saved += tokens - below
            seen.add(key)
            below = tokens
    return saved * m.prefill_per_token


def _alone(t: _Trajectory, w: Workload, m: ServerModel, prefill: bool = True) -> float:
    return (
        sum(t.turns) * (m.step_a + m.step_b)
        + sum(t.tools)
        + (_prefill_s(t, w, m) if prefill else 0.0)
    )


def _work(
    trajs: list[_Trajectory], w: Workload, m: ServerModel, servers: int, prefill: bool = True
) -> float:
    """The work every schedule must do, spread over the servers: each token decoded at full batch,
    each prompt and tool result prefilled once (``prefill=False``: the tokens alone, the bound
    reported before 2026-11-27)."""
    decode = sum(sum(t.turns) for t in trajs) * (m.step_b + m.step_a / m.max_batch)
    if not prefill:
        return decode / servers
    once = sum(_prefill_s(t, w, m) for t in trajs) - _shared_prefill_s(trajs, m)
    return (decode + once) / servers


def lower_bound(
    trajs: list[_Trajectory], w: Workload, m: ServerModel, servers: int, prefill: bool = True
) -> float:
    """max(longest trajectory alone on an idle server, all the work at full batch spread over the
    servers)."""
    return max(max(_alone(t, w, m, prefill) for t in trajs), _work(trajs, w, m, servers, prefill))


class _Sim:
    """The servers, the event queue and the routing; ``on_done`` is called as each trajectory
    finishes."""

    def __init__(
        self, balancer: Any, w: Workload, m: ServerModel, servers: int,
        priority: Callable[[str, int], int] | None, on_done: Callable[[_Trajectory], None],
    ) -> None:
        self.balancer, self.w, self.m, self.priority, self.on_done = (
            balancer, w, m, priority, on_done,
        )
        self.nodes = [_Server() for _ in range(servers)]
        self.trajs: dict[int, _Trajectory] = {}
        self.events: list[tuple[float, int, str, int]] = []  # (time, seq, kind, id)
        self.seq = 0
        self.hits = self.misses = 0
        self.prompt_tokens = self.cached_tokens = 0
        self.now = 0.0
        self.stopped = False
        # a weight update waiting for the running requests (its pause seconds)
        self.draining: float | None = None

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def push(self, t: float, kind: str, ident: int) -> None:
        heapq.heappush(self.events, (t, self.next_seq(), kind, ident))

    def start_turn(self, traj: _Trajectory) -> None:
        self.trajs[traj.index] = traj
        rid = f"traj-{traj.index}"
        if traj.chain or self.w.subagents:
            keys = (*(k for k, _ in traj.chain), traj_key(traj.index))
            server = self.balancer.acquire(rid, traj.context, prefix=keys)
        else:
            server = self.balancer.acquire(rid, traj.context)
        cached = traj.last_server == server
        if traj.turn:  # a later turn: its context is cached where its previous turn ran
            self.hits += cached
            self.misses += not cached
        uncached = self.w.tool_tokens if cached and traj.turn else traj.context
        uncached = min(uncached, traj.context - self._cached_prefix(traj, server))
        self.prompt_tokens += traj.context
        self.cached_tokens += traj.context - uncached
        rank = self.priority(f"traj-{traj.index}", traj.context) if self.priority is not None else 0
        heapq.heappush(self.nodes[server].waiting, (rank, self.next_seq(), traj.index, uncached))
        if not self.nodes[server].busy:
            self.step(server)

    def _cached_prefix(self, traj: _Trajectory, server: int) -> int:
        """Tokens of ``traj``'s shared prefixes that ``server`` holds; records that it now holds
        them all (the request's prompt is about to be read there)."""
        cached, hit = self.nodes[server].cached, 0
        for key, tokens in traj.chain:
            hit = max(hit, min(tokens, cached.get(key, 0)))
            cached[key] = max(tokens, cached.get(key, 0))
        return hit

    def step(self, server: int) -> None:
        node, m = self.nodes[server], self.m
        prefill = 0
        while node.waiting and len(node.running) < m.max_batch and self.draining is None:
            _, _, index, uncached = heapq.heappop(node.waiting)
            traj = self.trajs[index]
            node.running[index] = traj.turns[traj.turn]
            prefill += uncached
        if not node.running:
            node.busy = False
            if self.draining is not None and not any(n.running for n in self.nodes):
                self._apply_update(self.draining, keep_kv=False)
            return
        node.busy = True
        stall, node.stall = node.stall, 0.0
        self.push(
            self.now
            + stall
            + m.step_a
            + m.step_b * len(node.running)
            + m.prefill_per_token * prefill,
            "step",
            server,
        )

    def weight_update(self, pause_s: float, mode: str = "abort") -> None:
        """A weight update on every server.  ``abort`` (``manager.pause()`` + partial rollouts): the
        running requests are cut and re-issued, re-reading their contexts, and the prefix caches are
        emptied; ``drain`` (``manager.update_weights`` alone): new requests wait until every running
        one has finished, then the update runs and the caches are emptied; ``keep``
        (``server.weight_update: keep``): running requests are frozen for the pause and go on with
        their KV cache, the prefix caches are kept.
        """
        if mode == "drain":
            self.draining = pause_s
            if not any(n.running for n in self.nodes):
                self._apply_update(pause_s, keep_kv=False)
            return
        self._apply_update(pause_s, keep_kv=mode == "keep")
        if mode == "abort":
            for node in self.nodes:
                node.stall += self.m.prefill_per_token * sum(
                    self.trajs[i].context for i in node.running
                )

    def _apply_update(self, pause_s: float, keep_kv: bool) -> None:
        self.draining = None
        for node in self.nodes:
            node.stall += pause_s
        if not keep_kv:
            for traj in self.trajs.values():
                traj.last_server = None
            for node in self.nodes:
                node.cached.clear()
        for server, node in enumerate(self.nodes):
            if not node.busy and node.waiting:
                self.step(server)

    def run(self) -> None:
        while self.events and not self.stopped:
            self.now, _, kind, ident = heapq.heappop(self.events)
            if kind == "tool":
                self.start_turn(self.trajs[ident])
                continue
            node = self.nodes[ident]
            finished = []
            for index in list(node.running):
                node.running[index] -= 1
                node.tokens += 1
                if node.running[index] == 0:
                    finished.append(index)
            for index in finished:
                del node.running[index]
                self.balancer.release(ident)
                traj = self.trajs[index]
                if traj.turn == 0 and traj.children:  # they read its context so far here
                    node.cached[traj_key(index)] = traj.context + traj.turns[0]
                    for child in traj.children:
                        self.start_turn(child)
                traj.context += traj.turns[traj.turn] + self.w.tool_tokens
                traj.last_server = ident
                if traj.turn + 1 < len(traj.turns):
                    self.push(self.now + traj.tools[traj.turn], "tool", index)
                    traj.turn += 1
                else:
                    traj.done_at = self.now
                    del self.trajs[index]
                    self.on_done(traj)
            self.step(ident)

    def result(self) -> dict[str, float]:
        tokens = [n.tokens for n in self.nodes]
        return {"prefix_hit_rate": self.hits / max(1, self.hits + self.misses),
                "prompt_token_hit_rate": self.cached_tokens / max(1, self.prompt_tokens),
                "load_imbalance": max(tokens) / (sum(tokens) / len(tokens)) if sum(tokens) else 1.0}


def simulate(
    balancer_factory: Callable[[int], Any], w: Workload | None = None, m: ServerModel | None = None,
    servers: int = 8, priority: Callable[[str, int], int] | None = None,
) -> dict[str, float]:
    """Run one synchronous batch through ``balancer_factory(servers)`` (e.g.
    ``agentloop.routing.strategies.make_balancer``; anything with
    ``acquire(request_id, prompt_len)`` and ``release(server)``) and report what happened.

    ``priority(request_id, prompt_len)`` (as the router computes it, e.g.
    :class:`agentloop.routing.tail.ContextPriority`) orders each server's waiting requests as vLLM's
    priority scheduler does: lowest value first, ties in arrival order; without it, arrival order.
    """
    w, m = w or Workload(), m or ServerModel()
    trajs = make_trajectories(w)
    sim = _Sim(balancer_factory(servers), w, m, servers, priority, lambda t: None)
    for traj in trajs:
        if not traj.is_child:
            sim.start_turn(traj)
    sim.run()
    bound, decode = (
        lower_bound(trajs, w, m, servers),
        lower_bound(trajs, w, m, servers, prefill=False),
    )
    return {
        "makespan_s": sim.now, "lower_bound_s": bound, "ratio": sim.now / bound,
        "decode_bound_s": decode, "decode_ratio": sim.now / decode, **sim.result(),
    }


def simulate_stream(
    balancer_factory: Callable[[int], Any], w: Workload | None = None, m: ServerModel | None = None,
    servers: int = 8, *, batches: int = 6, in_flight: int | None = None, sync_s: float = 2.0,
    max_staleness: int | None = 1, priority: Callable[[str, int], int] | None = None,
    update: str = "abort",
) -> dict[str, float]:
    """The Rollouter regime (module docstring): ``batches`` hand-outs of ``w.trajectories`` finished
    trajectories each, ``in_flight`` (default: one batch) running at all times.

    ``ratio`` is the mean time per hand-out after the first over the mean work bound of the
    trajectories handed out (their tokens at full batch and their prompts and tool results prefilled
    once, over the servers, plus ``sync_s``; ``decode_ratio``: against their tokens alone);
    ``first_batch_s`` is the cold start (it fills from empty as a synchronous batch does);
    ``wasted_tokens`` the share of generated tokens thrown away with stale trajectories;
    ``mean_staleness`` the versions the trajectories handed out lag behind on average. ``update``:
    how the weight update after each hand-out treats running requests (:meth:`_Sim.weight_update`:
    abort, drain or keep)."""
    if update not in ("abort", "drain", "keep"):
        raise ValueError(f"update must be 'abort', 'drain' or 'keep', not {update!r}")
    if w is not None and w.subagents:
        raise ValueError("simulate_stream does not fork sub-agents (Workload.subagents must be 0)")
    w, m = w or Workload(), m or ServerModel()
    batch, in_flight = w.trajectories, in_flight or w.trajectories
    rng = random.Random(w.seed)
    counter = iter(range(1 << 62))
    version = 0
    handed: list[list[_Trajectory]] = []
    ready: list[_Trajectory] = []
    times: list[float] = []
    wasted = total = 0
    lags: list[int] = []
    # tokens generated by each hand-out (all trajectories, finished or not)
    generated: list[int] = []

    def fresh() -> Iterator[_Trajectory]:
        while True:
            traj = _trajectory(rng, w, next(counter))
            traj.version = version
            yield traj

    source = fresh()
    sim: _Sim

    def on_done(traj: _Trajectory) -> None:
        nonlocal version, wasted, total
        tokens = sum(traj.turns)
        total += tokens
        if max_staleness is not None and version - traj.version > max_staleness:
            wasted += tokens
        else:
            ready.append(traj)
        if len(ready) >= batch:
            handed.append(ready[:batch])
            del ready[:batch]
            lags.extend(version - t.version for t in handed[-1])
            times.append(sim.now)
            generated.append(sum(node.tokens for node in sim.nodes))
            if len(handed) == batches:
                sim.stopped = True
                return
            version += 1
            sim.weight_update(sync_s, update)
        sim.start_turn(next(source))

    sim = _Sim(balancer_factory(servers), w, m, servers, priority, on_done)
    for _ in range(in_flight):
        sim.start_turn(next(source))
    sim.run()
    if len(handed) < 2:
        raise ValueError(
            "simulate_stream needs batches >= 2 (the first hand-out is the cold start)"
        )
    steady = times[-1] - times[0]
    per_token = (m.step_b + m.step_a / m.max_batch) / servers
    # one update per hand-out
    bound = statistics.mean(_work(h, w, m, servers) for h in handed[1:]) + sync_s
    decode = statistics.mean(_work(h, w, m, servers, prefill=False) for h in handed[1:])
    per_batch = steady / (len(times) - 1)
    return {
        "batch_s": per_batch, "first_batch_s": times[0], "work_bound_s": bound,
        "ratio": per_batch / bound, "decode_bound_s": decode, "decode_ratio": per_batch / decode,
        "utilisation": (generated[-1] - generated[0]) * per_token / steady,
        "wasted_tokens": wasted / max(1, total), "mean_staleness": statistics.mean(lags),
        **sim.result(),
    }
