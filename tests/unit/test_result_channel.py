"""The result channel on loopback (no Ray): a worker's frames reach the dispatch that expects them,
intact and in order; a connection without the key is never read; a closed connection wakes the
waiting driver; a broken connection makes ``send`` say so (the worker then yields through Ray)."""

from __future__ import annotations

import asyncio
import pickle
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from agentloop.config.checks import check_result_channel
from agentloop.errors import ConfigError
from agentloop.rollout.result_channel import ResultChannel, ResultSender


@pytest.fixture
def channel() -> Iterator[ResultChannel]:
    ch = ResultChannel(host="127.0.0.1")
    yield ch
    ch.close()


class Loop:
    """An event loop in a thread, as a worker actor has one."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def loop() -> Iterator[Loop]:
    lp = Loop()
    yield lp
    lp.stop()


def connected_sender(channel: ResultChannel, loop: Loop, worker_id: str = "w1") -> ResultSender:
    sender = ResultSender(*channel.endpoint, worker_id=worker_id)
    loop.run(sender.connect())
    assert channel.wait_connected([worker_id], 5.0)
    return sender


def take_all(channel: ResultChannel, tokens: set[int], n: int, timeout: float = 5.0) -> list:
    got: list[tuple[int, Any]] = []
    end = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < end:
        got += [(t, pickle.loads(p)) for t, p in channel.take(tokens, 0.5)]
    return got


def test_frames_reach_the_dispatch_that_expects_them_in_order(channel, loop):
    sender = connected_sender(channel, loop)
    channel.expect(7)
    channel.expect(8)
    for g in range(3):
        assert loop.run(sender.send(7, (g, f"rows {g}", {"metrics": [g]})))
    assert loop.run(sender.send(8, (0, "other dispatch", None)))
    got = take_all(channel, {7}, 3)
    assert got == [(7, (g, f"rows {g}", {"metrics": [g]})) for g in range(3)]
    assert take_all(channel, {8}, 1) == [(8, (0, "other dispatch", None))]


def test_frames_nobody_expects_are_dropped(channel, loop):
    sender = connected_sender(channel, loop)
    channel.expect(3)
    assert loop.run(sender.send(99, "stale"))  # e.g. a cancelled dispatch's last group
    assert loop.run(sender.send(3, "wanted"))
    assert take_all(channel, {3, 99}, 1) == [(3, "wanted")]
    channel.forget(3)
    assert loop.run(sender.send(3, "after forget"))
    assert channel.take({3}, 0.3) == []


def test_a_large_frame_arrives_intact(channel, loop):
    sender = connected_sender(channel, loop)
    channel.expect(1)
    rows = np.random.default_rng(0).integers(0, 2**31, size=(512, 4096), dtype=np.int64)  # 16 MB
    assert loop.run(sender.send(1, rows), timeout=30)
    ((token, got),) = take_all(channel, {1}, 1, timeout=30)
    assert token == 1 and np.array_equal(got, rows)


def test_streams_sharing_a_connection_never_mix_their_frames(channel, loop):
    sender = connected_sender(channel, loop)
    for t in (1, 2):
        channel.expect(t)
    big = bytes(3_000_000)

    async def both() -> list[bool]:
        async def stream(token: int) -> bool:
            return all([await sender.send(token, (i, big)) for i in range(3)])
        return await asyncio.gather(stream(1), stream(2))

    assert loop.run(both(), timeout=30) == [True, True]
    got = take_all(channel, {1, 2}, 6, timeout=30)
    for t in (1, 2):
        assert [item[0] for token, item in got if token == t] == [0, 1, 2]


def test_a_connection_without_the_key_is_closed_unread(channel, loop):
    wrong = ResultSender(channel.address[0], channel.address[1], b"x" * 32, worker_id="intruder")
    loop.run(wrong.connect())  # the handshake is one-way: the driver judges, then closes
    channel.expect(5)
    time.sleep(0.2)
    assert not channel.connected("intruder")
    loop.run(wrong.send(5, "pickle from someone else"))
    assert channel.take({5}, 0.3) == []


def test_a_closed_connection_wakes_the_waiting_driver(channel, loop):
    sender = connected_sender(channel, loop)
    channel.expect(1)
    threading.Timer(0.2, sender.close).start()
    start = time.monotonic()
    assert channel.take({1}, 10.0) == []
    assert time.monotonic() - start < 5.0  # woken by the close, not by the timeout
    assert not channel.connected("w1")


def test_send_says_false_once_the_driver_is_gone(loop):
    channel = ResultChannel(host="127.0.0.1")
    sender = connected_sender(channel, loop)
    channel.close()
    payload = bytes(1_000_000)
    results = [loop.run(sender.send(1, payload)) for _ in range(20)]
    assert results[-1] is False and not sender.up  # the rows then go through Ray's stream


def test_connect_fails_fast_where_nobody_listens(loop):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    sender = ResultSender("127.0.0.1", port, b"k" * 32, worker_id="w")
    with pytest.raises(OSError):
        loop.run(sender.connect(timeout=2.0))
    assert not sender.up
    assert loop.run(sender.send(1, "rows")) is False


def test_the_config_key_takes_tcp_or_ray_only():
    for value in ("tcp", "ray"):
        check_result_channel(value)
    with pytest.raises(ConfigError, match=r"agent\.result_channel must be 'tcp' .* or 'ray'"):
        check_result_channel("zmq")


def test_rows_that_do_not_pickle_are_left_to_ray(channel, loop):
    sender = connected_sender(channel, loop)
    channel.expect(1)
    assert loop.run(sender.send(1, {"column": lambda: 0})) is False  # the worker yields it instead
    assert sender.up and loop.run(sender.send(1, "next rows"))
    assert take_all(channel, {1}, 1) == [(1, "next rows")]
