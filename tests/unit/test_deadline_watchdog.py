"""utils.deadline.within: long limits held by the per-loop watchdog behave as asyncio.timeout."""

from __future__ import annotations

import asyncio

import pytest

from agentloop.utils import deadline
from agentloop.utils.deadline import within


@pytest.fixture
def coarse(monkeypatch):
    """Every limit of 0.05 s or more goes to the watchdog (short, so the tests run fast)."""
    monkeypatch.setattr(deadline, "COARSE_ABOVE", 0.05)
    monkeypatch.setattr(deadline, "WATCH_SLACK", 0.01)


def test_returns_and_times_out(coarse):
    async def main():
        assert await within(asyncio.sleep(0.01, result=7), 0.5) == 7
        started = asyncio.get_running_loop().time()
        with pytest.raises(asyncio.TimeoutError):
            await within(asyncio.sleep(5), 0.1)
        waited = asyncio.get_running_loop().time() - started
        assert 0.09 <= waited < 1.0
        # the task goes on normally afterwards: no cancel request left over
        assert asyncio.current_task().cancelling() == 0
        await asyncio.sleep(0.01)

    asyncio.run(main())


def test_many_concurrent_limits_each_fire_on_their_own(coarse):
    async def one(i: int) -> str:
        try:
            await within(asyncio.sleep(0.05 if i % 2 else 5), 0.1 + 0.01 * (i % 5))
            return "done"
        except asyncio.TimeoutError:
            return "timeout"

    async def main():
        return await asyncio.gather(*(one(i) for i in range(50)))

    results = asyncio.run(main())
    assert results == ["done" if i % 2 else "timeout" for i in range(50)]


def test_outer_limit_wins_over_inner_and_caller_cancel_is_not_a_timeout(coarse):
    async def nested():
        await within(within(asyncio.sleep(5), 2.0), 0.1)

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await nested()
        task = asyncio.create_task(within(asyncio.sleep(5), 2.0))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_short_limits_use_asyncio_timeout():
    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await within(asyncio.sleep(5), 0.02)
        assert not deadline._watchdogs.get(asyncio.get_running_loop(), None) or not (
            deadline._watchdogs[asyncio.get_running_loop()].deadlines
        )

    asyncio.run(main())


def test_a_finished_loop_is_not_kept_alive(coarse):
    import gc
    import weakref

    loops = []

    async def main():
        loops.append(weakref.ref(asyncio.get_running_loop()))
        await within(asyncio.sleep(0.01), 1.0)

    asyncio.run(main())
    gc.collect()
    assert loops[0]() is None


def test_limits_one_after_another_share_one_timer(coarse):
    """The watchdog's point: sequential limits (a tool turn's create, execute, release) do not arm
    an event-loop timer each."""

    async def main() -> int:
        loop = asyncio.get_running_loop()
        armed = []
        call_at = loop.call_at

        def counting_call_at(*args, **kwargs):
            armed.append(args[0])
            return call_at(*args, **kwargs)

        loop.call_at = counting_call_at  # type: ignore[method-assign]
        for _ in range(100):
            assert await within(asyncio.sleep(0, "ok"), 30.0) == "ok"
        return len(armed)

    assert asyncio.run(main()) == 1
