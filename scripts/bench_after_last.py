"""Serial time after the batch's last sample (``agent_loop/serial/after_last_sample``), in parts.

The real ``AgentLoopManager`` with one worker actor (chunks of ``--chunk`` rows) and one
``ScriptedServer`` actor answering every request after ``--delay`` seconds with ``--tokens`` tokens
(log-probs on), so every sample of a ``--rows`` batch finishes in one wave and the time after the
last one is the stack's own: padding, pickling and shipping each chunk, the driver's concat, the
servers' health check, the metrics. Passes take turns between the code before (every column sent
as it is, in the driver and the worker alike; the health probes sent after the concat), the derived
columns left out (``agentloop.batch.protocol_wire.elide``) with the probes sent before the concat,
the padding runs trimmed too (``protocol_wire.trim_runs``), runs of finished samples padded while
the rest run (``agentloop.rollout.group_padding``), and the shipped code (those runs encoded for
the wire then too, ``group_padding.ENCODE_AHEAD``; ``--kinds 3 4`` alternates these two only), and
those rows sent on the TCP result channel instead of Ray's stream (``agent.result_channel: tcp``,
``agentloop.rollout.result_channel``; ``--kinds 4 5`` alternates Ray's stream and the channel);
per kind it prints medians of:

* ``after``: ``agent_loop/serial/after_last_sample``;
* ``recv_last``: from the last sample's end to the driver holding the last chunk (worker padding,
  pickling, Ray's transfer, unpickling);
* ``concat``, ``check``: ``DataProto.concat`` and ``supervisor.check`` in the driver;
* ``w_pad``, ``w_pickle``: the worker's padding and wire encoding (pickling, or runs encoded
  ahead) of the chunks still to come when the last sample finished; ``w_last_out``: from that
  moment to the end of the last wire encoding;
* ``ray_gap``: ``recv_last - w_last_out`` (Ray's hand-over of the last chunk, the driver's
  unpickling; with runs encoded ahead also the join of their states and Ray's pickling of it);
* ``wire``: the pickled size of one chunk's rows (KB) and its parts (tensors, non-tensor columns,
  per-row metrics).

``--floor N``: then N passes of the hand-over alone, the floor under ``ray_gap``: an async actor's
streaming generator yields, after ``--delay`` seconds, 64 KB of bytes or the last chunk as the
worker yields it (its wire state, per-row metrics and all), in turn, and the driver waits for it,
takes it and loads it as the dispatcher does; printed: ms from the yield to the driver holding it.
In turn with those, the same two items pickled by the actor and written to a plain TCP connection on
loopback, read and loaded by the driver: what the hand-over costs outside Ray (a measurement only;
the stack's results go through Ray).

    RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false \\
        python scripts/bench_after_last.py [--passes 30] [--warmup 3] [--rows 256] [--chunk 128]
        [--spread 0.05] [--kinds 3 4] [--floor 30]
"""

from __future__ import annotations

import argparse
import asyncio
import pickle
import random
import socket
import statistics
import time
from collections import defaultdict
from typing import Any

import numpy as np
import ray
from omegaconf import OmegaConf

from agentloop.batch import protocol_wire
from agentloop.batch.data import rows_to_batch
from agentloop.batch.protocol import DataProto
from agentloop.batch.wire_runs import EncodedRows
from agentloop.cluster.placement import ServerGroup
from agentloop.config import default_config
from agentloop.rollout import dispatcher, group_padding
from agentloop.rollout.manager import AgentLoopManager
from agentloop.testing import ScriptedServer
from agentloop.testing.tiny_model import ensure_tiny_model
from agentloop.utils.process import restore_normal_priority

EOS = 2


NEVER = 1 << 30
KINDS = {
    "old (every column, late probe)": (False, False, NEVER, False),
    "derived left out, early probe": (True, False, NEVER, False),
    "new (+ padding runs trimmed)": (True, True, NEVER, False),
    "+ padded as they finish": (True, True, group_padding.MIN_RUN, False),
    "+ runs encoded ahead (shipped)": (True, True, group_padding.MIN_RUN, True),
    "+ rows on the TCP result channel": (True, True, group_padding.MIN_RUN, True),
}
"""Pass kinds, in turn: (``protocol_wire.elide``, ``protocol_wire.trim_runs``,
``group_padding.MIN_RUN``: NEVER pads each group only when it is done,
``group_padding.ENCODE_AHEAD``); the last kind also sends the rows on the result channel
(``agent.result_channel: tcp``; the others through Ray's stream)."""
CHANNEL_KIND = "+ rows on the TCP result channel"


def _set_switches(_actor: Any, elide: bool, trim_runs: bool, min_run: int, encode: bool) -> None:
    """Run in a worker actor (``__ray_call__``; cloudpickle imports the module there by name), or
    here with None: the pickling's and the early padding's switches."""
    protocol_wire.elide, protocol_wire.trim_runs = elide, trim_runs
    group_padding.MIN_RUN, group_padding.ENCODE_AHEAD = min_run, encode


def _trace_worker(actor: Any) -> None:
    """Run in a worker actor (``__ray_call__``): record ``time.time()`` around each group's padding
    (``_postprocess``) and each wire encoding (``DataProto.wire_state``: a pickling, or a run
    encoded ahead), in ``actor._bench_marks``."""
    from agentloop.batch.protocol import DataProto as Proto  # the worker process's own class

    marks: list[tuple[str, float, float]] = []
    actor._bench_marks = marks
    pad, getstate = actor._postprocess, Proto.wire_state

    def timed_pad(*a: Any, **k: Any) -> Any:
        t = time.time()
        out = pad(*a, **k)
        marks.append(("pad", t, time.time()))
        return out

    def timed_getstate(self: Any, *a: Any, **k: Any) -> Any:
        t = time.time()
        out = getstate(self, *a, **k)
        marks.append(("pickle", t, time.time()))
        return out

    actor._postprocess = timed_pad
    Proto.wire_state = timed_getstate


def _take_marks(actor: Any) -> list[tuple[str, float, float]]:
    """Run in a worker actor: the marks recorded since the last call."""
    marks = list(actor._bench_marks)
    actor._bench_marks.clear()
    return marks


def build(args: argparse.Namespace) -> AgentLoopManager:
    """The manager over one ScriptedServer actor and ``ceil(rows / chunk)`` chunks on one worker."""
    tokens = [5] * (args.tokens - 1) + [EOS]
    server = ray.remote(num_cpus=0)(ScriptedServer).options(max_concurrency=4 * args.rows)
    if args.spread:  # 1 to --tokens tokens at random, one per spread / tokens seconds
        handle = server.remote(
            lambda ids, p, r: tokens[-random.randint(1, len(tokens)):], eos_token_id=EOS,
            delay=args.delay, token_delay=args.spread / args.tokens,
        )
    else:
        handle = server.remote(lambda ids, p, r: tokens, eos_token_id=EOS, delay=args.delay)
    group = ServerGroup(
        handles=[handle], placement_group=None, device="cpu", info=[{}], placement="standalone"
    )
    cfg = default_config()
    cfg.actor_rollout_ref.model.path = str(ensure_tiny_model())
    cfg.data.max_prompt_length, cfg.data.max_response_length = 128, args.tokens
    rollout = cfg.actor_rollout_ref.rollout
    for key, value in {
        "agent.num_workers": 1, "free_cache_engine": False, "calculate_log_probs": True,
        "agent.result_channel": "tcp",  # opened and connected; used by CHANNEL_KIND's passes only
    }.items():
        OmegaConf.update(rollout, key, value)
    manager = AgentLoopManager(cfg, servers=group)
    manager.workers.chunks_per_worker = max(1, -(-args.rows // args.chunk))
    return manager


def instrument(
    manager: AgentLoopManager, times: dict[str, float], got: list[Any], mode: dict[str, bool]
) -> None:
    """Timers around the driver's concat, health check and receipt of each chunk; while
    ``mode["late_probe"]`` the health probes leave only after the concat (the code before)."""
    concat, check, take = DataProto.concat, manager.supervisor.check, dispatcher.DispatchRun._take
    probe = manager.supervisor.probe

    def timed_concat(parts: list[DataProto]) -> DataProto:
        t = time.perf_counter()
        out = concat(parts)
        times["concat"] = time.perf_counter() - t
        return out

    def early_probe() -> dict[int, Any]:
        return {} if mode["late_probe"] else probe()

    def timed_check(*args: Any) -> list[int]:
        t = time.perf_counter()
        out = check(probe()) if mode["late_probe"] else check(*args)
        times["check"] = time.perf_counter() - t
        return out

    def timed_take(run: Any, dispatch: Any, fetch: Any = None) -> list[Any]:
        out = take(run, dispatch, fetch)
        got.extend((time.time(), f) for f in out)
        return out

    DataProto.concat = staticmethod(timed_concat)  # type: ignore[method-assign]
    manager.supervisor.check = timed_check  # type: ignore[method-assign]
    manager.supervisor.probe = early_probe  # type: ignore[method-assign]
    dispatcher.DispatchRun._take = timed_take  # type: ignore[method-assign]


def wire_sizes(part: Any) -> dict[str, float]:
    """Pickled KB of one received chunk: its rows, their tensors, non-tensor columns, metrics."""
    rows: DataProto = part.rows
    state = rows.__getstate__()
    return {
        "wire": len(pickle.dumps((0, rows, part.stats), protocol=5)) / 1e3,
        "wire_tensors": len(pickle.dumps(state["batch"], protocol=5)) / 1e3,
        "wire_non_tensor": len(pickle.dumps(rows.non_tensor_batch, protocol=5)) / 1e3,
        "wire_metrics": len(pickle.dumps(part.stats.metrics, protocol=5)) / 1e3,
    }


def one_pass(manager: AgentLoopManager, step: int, rows: int, times: dict[str, float],
             got: list[Any]) -> dict[str, float]:
    """One batch of fresh prompts; its after-last time and parts (ms; sizes KB)."""
    got.clear()
    batch = rows_to_batch(
        [{"prompt": [{"role": "user", "content": f"s{step} q{i}"}]} for i in range(rows)]
    )
    out = manager.generate_sequences(batch)
    last = max(f.stats.done_at for _, f in got)
    handles = manager.workers.handles
    marks = [m for h in handles for m in ray.get(h.__ray_call__.remote(_take_marks))]
    pads = [(a, b) for kind, a, b in marks if kind == "pad" and b >= last]
    pickles = [(a, b) for kind, a, b in marks if kind == "pickle" and b >= last]
    worker = {
        "w_pad": sum(b - a for a, b in pads) * 1e3,
        "w_pickle": sum(b - a for a, b in pickles) * 1e3,
        "w_last_out": (max((b for _, b in pickles), default=last) - last) * 1e3,
    }
    recv_last = (max(t for t, _ in got) - last) * 1e3
    return {
        "after": out.meta_info["timing"]["agent_loop/serial/after_last_sample"] * 1e3,
        "recv_last": recv_last,
        "ray_gap": recv_last - worker["w_last_out"],
        "concat": times.get("concat", 0.0) * 1e3,
        "check": times.get("check", 0.0) * 1e3,
        **worker,
        **wire_sizes(got[-1][1]),
    }


@ray.remote(num_cpus=0)
class _Floor:
    """Yields one item after a delay, stamped with ``time.time()`` at the yield."""

    def __init__(self, state: dict[str, Any], rows: int, stats: Any) -> None:
        restore_normal_priority(True)  # as a worker actor does (Ray starts actors at nice 15)
        # encoded here (built from its state): Ray pickles it at the yield as it is
        self.chunk = (0, EncodedRows(state, {}, rows), stats)

    async def stream(self, delay: float, kind: str) -> Any:
        await asyncio.sleep(delay)
        yield time.time(), np.zeros(64_000, np.uint8) if kind == "bytes" else self.chunk

    async def connect(self, port: int) -> None:
        """Open the plain TCP connection :meth:`send` writes to (the driver listens)."""
        _, self.writer = await asyncio.open_connection("127.0.0.1", port)

    async def send(self, delay: float, kind: str) -> None:
        """The same item, pickled here and written to the TCP connection (length first): what
        the hand-over costs outside Ray's streaming generator, pickling and loading included."""
        await asyncio.sleep(delay)
        item = (time.time(), np.zeros(64_000, np.uint8) if kind == "bytes" else self.chunk)
        data = pickle.dumps(item, protocol=5)
        self.writer.write(len(data).to_bytes(8, "big") + data)
        await self.writer.drain()


def _recv(conn: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("the floor actor closed its connection")
        got += k
    return buf


def floor(part: Any, passes: int, delay: float) -> None:
    """The hand-over alone (``--floor``): 64 KB of bytes and the last chunk received (``part``),
    in turn."""
    actor = _Floor.remote(  # type: ignore[attr-defined]
        part.rows.wire_state(shrink=True), len(part.rows), part.stats  # as the worker encodes it
    )
    kinds = {"64 KB of bytes": "bytes", "the last chunk (wire state, metrics)": "chunk"}
    listener = socket.create_server(("127.0.0.1", 0))
    connected = actor.connect.remote(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ray.get(connected)
    took: dict[str, list[float]] = defaultdict(list)
    for i in range(4 * (passes + 2)):
        name = list(kinds)[i % 2]
        if i % 4 < 2:
            stream = actor.stream.options(num_returns="streaming").remote(delay, kinds[name])
            ray.wait([stream], num_returns=1)  # as the dispatcher takes an item
            yielded, _ = ray.get(next(stream))
        else:
            sent = actor.send.remote(delay, kinds[name])
            yielded, _ = pickle.loads(_recv(conn, int.from_bytes(_recv(conn, 8), "big")))
            name = f"{name}, plain TCP (pickled)"
        if i >= 8:
            took[name].append((time.time() - yielded) * 1e3)
        if i % 4 >= 2:
            ray.get(sent)
    conn.close()
    listener.close()
    print(f"hand-over alone, {passes} passes each in turn: yield -> the driver holding it")
    for name, values in took.items():
        print(f"  {name:58s} {statistics.median(values):6.2f} ms  "
              f"({min(values):.2f}-{max(values):.2f})")
    ray.kill(actor)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=30, help="timed passes (kinds take turns)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=128, help="rows per worker chunk")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--delay", type=float, default=0.3, help="server seconds per request")
    ap.add_argument("--spread", type=float, default=0.0,
                    help="seconds over which the samples finish (each answers 1 to --tokens "
                    "tokens at random, one per spread / tokens seconds); 0: all in one wave")
    ap.add_argument("--kinds", nargs="*", type=int, default=None,
                    help="pass kinds to alternate, by number (0-5, in the order printed by "
                    "default); all when not given")
    ap.add_argument("--floor", type=int, default=0,
                    help="then this many passes of the hand-over alone (the floor under ray_gap)")
    args = ap.parse_args()
    kinds = [k for i, k in enumerate(KINDS) if args.kinds is None or i in args.kinds]
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    manager = build(args)
    channel = manager.workers.channel
    times: dict[str, float] = {}
    got: list[Any] = []
    mode = {"late_probe": False}
    instrument(manager, times, got, mode)
    ray.get([h.__ray_call__.remote(_trace_worker) for h in manager.workers.handles])
    results: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for step in range(args.warmup + args.passes):
        kind = kinds[step % len(kinds)]
        switches = KINDS[kind]
        manager.workers.channel = channel if kind == CHANNEL_KIND else None
        _set_switches(None, *switches)
        mode["late_probe"] = not switches[0]
        ray.get([h.__ray_call__.remote(_set_switches, *switches)
                 for h in manager.workers.handles])
        sample = one_pass(manager, step, args.rows, times, got)
        if step >= args.warmup:
            for key, value in sample.items():
                results[kind][key].append(value)
    print(f"{args.rows} rows in chunks of {args.chunk}, {args.tokens} tokens, "
          f"{args.passes} passes, kinds in turn; medians (min-max)")
    for kind, columns in results.items():
        print(f"{kind}:")
        for key, values in columns.items():
            unit = "KB" if key.startswith("wire") else "ms"
            print(f"  {key:16s} {statistics.median(values):7.2f} {unit}  "
                  f"({min(values):.2f}-{max(values):.2f})")
    if args.floor:
        floor(got[-1][1], args.floor, args.delay)
    manager.workers.channel = channel  # closed with the workers
    manager.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
