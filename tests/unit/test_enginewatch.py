"""EngineWatch: a request waiting on an engine that died is failed within the watch interval, never left
waiting; a caller's own cancellation stays a cancellation; requests on a live engine are untouched."""

from __future__ import annotations

import asyncio

import pytest

from agentloop.servers.base import ServerDeadError
from agentloop.servers.enginewatch import EngineWatch


class ForgetfulServer:
    """A server whose engine never answers (vLLM's lost request) and can die."""

    def __init__(self) -> None:
        self.dead = False
        self.watch = EngineWatch(lambda: self.dead, interval=0.01)

    async def generate(self, seconds: float = 3600.0) -> str:
        with self.watch.request():
            try:
                await asyncio.sleep(seconds)  # waiting for outputs
                return "done"
            except BaseException as e:
                if self.watch.cut_by_death(e):
                    raise ServerDeadError("engine died", 0) from e
                raise


def test_a_request_forgotten_by_a_dead_engine_fails_as_server_dead():
    async def main() -> None:
        server = ForgetfulServer()
        server.watch.start()
        stuck = asyncio.ensure_future(server.generate())
        quick = asyncio.ensure_future(server.generate(0.0))
        await asyncio.sleep(0.05)
        assert not stuck.done() and await quick == "done"  # a live engine: nothing is cut
        server.dead = True
        with pytest.raises(ServerDeadError):
            await asyncio.wait_for(stuck, 2.0)
        server.watch.stop()

    asyncio.run(main())


def test_a_callers_own_cancellation_is_not_turned_into_a_server_error():
    async def main() -> None:
        server = ForgetfulServer()
        server.watch.start()
        task = asyncio.ensure_future(server.generate())
        await asyncio.sleep(0.03)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        server.dead = True
        await asyncio.sleep(0.05)  # the watch finds nothing left to cut
        assert not server.watch._running
        server.watch.stop()

    asyncio.run(main())


def test_a_request_in_a_batch_task_gets_the_error_so_the_batch_completes():
    """generate_batch runs each request in its own task and waits for all: a cut request must come back as
    an error (not vanish as a cancelled task), or the batch waits forever."""
    from agentloop.servers.base import BatchGenerateMixin

    class Batched(ForgetfulServer, BatchGenerateMixin):
        pass

    async def main() -> list:
        server = Batched()
        server.watch.start()

        async def kill_soon() -> None:
            await asyncio.sleep(0.05)
            server.dead = True

        killer = asyncio.ensure_future(kill_soon())
        got = [item async for group in server.generate_batch([{"seconds": 0.0}, {}, {}]) for item in group]
        await killer
        server.watch.stop()
        return sorted(got, key=lambda x: x[0])

    got = asyncio.run(main())
    assert got[0] == (0, "done")
    assert all(isinstance(r, ServerDeadError) for _, r in got[1:])
