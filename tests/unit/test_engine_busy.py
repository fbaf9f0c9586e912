"""The servers' busy clock: seconds with at least one request in the engine (the engine-busy
fraction of the Rollouter's metrics and scripts/bench_async.py)."""

from __future__ import annotations

import asyncio

from agentloop.testing import ScriptedServer


def test_busy_clock_counts_only_time_with_requests_in_the_engine() -> None:
    async def main() -> None:
        server = ScriptedServer(delay=0.2)
        assert server.busy_seconds() == 0.0
        await asyncio.sleep(0.2)  # idle: no request, the clock does not move
        assert server.busy_seconds() == 0.0
        await server.generate([1, 2, 3], {"max_tokens": 2}, request_id="a")
        one = server.busy_seconds()
        assert one >= 0.2
        # two overlapping requests: wall time counted once, not per request
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.gather(server.generate([1], {"max_tokens": 2}, request_id="b"),
                             server.generate([2], {"max_tokens": 2}, request_id="c"))
        wall = loop.time() - t0
        two = server.busy_seconds() - one
        assert 0.2 <= two <= wall + 0.01
        # while a request runs, the clock advances without waiting for it to end
        task = asyncio.create_task(server.generate([1], {"max_tokens": 2}, request_id="d"))
        await asyncio.sleep(0.1)
        assert server.busy_seconds() > one + two
        await task

    asyncio.run(main())


def test_requests_held_by_a_pause_are_not_busy() -> None:
    async def main() -> None:
        server = ScriptedServer(delay=0.05)
        await server.pause()
        held = asyncio.create_task(server.generate([1], {"max_tokens": 2}, request_id="held"))
        await asyncio.sleep(1.0)
        assert server.busy_seconds() == 0.0  # held at the gate, never reached the engine
        await server.resume()
        out = await held
        assert out.token_ids  # it ran after the resume
        assert 0.05 <= server.busy_seconds() < 1.0  # the second held is not counted

    asyncio.run(main())
