"""EngineWatch: a request waiting on an engine that died is failed within the watch interval, never
left waiting; a caller's own cancellation stays a cancellation; requests on a live engine are
untouched.

No test depends on how fast this box runs: the fake engine makes progress at each look of the watch
(not on a timer), a test waits for the watch to have looked after a given time instead of sleeping,
and a request that must be cut gets a generous deadline (it is cut within one interval when the
watch works)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from agentloop.cluster.enginewatch import EngineWatch
from agentloop.servers.base import ServerDeadError

CUT_WITHIN = 30.0
"""Seconds a request that must be cut may take (it takes one watch interval; the bound only stops
a hang)."""


class ForgetfulServer:
    """A server whose engine never answers (vLLM's lost request) and can die."""

    def __init__(self) -> None:
        self.dead = False
        self.last_look = float("-inf")
        self.watch = EngineWatch(self.is_dead, interval=0.01)

    def is_dead(self) -> bool:
        """The watch's look at the engine (it looks once per interval)."""
        self.last_look = time.monotonic()
        return self.dead

    async def watched_for(self, seconds: float) -> None:
        """Wait until the watch has looked at the engine at least ``seconds`` from now, however slow
        the box (or has taken it for hung: then it no longer asks whether the engine is dead)."""
        end = time.monotonic() + seconds
        while self.last_look < end and self.watch.stalled is None:
            await asyncio.sleep(0.005)

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
        await server.watched_for(0.05)
        assert not stuck.done() and await quick == "done"  # a live engine: nothing is cut
        server.dead = True
        with pytest.raises(ServerDeadError):
            await asyncio.wait_for(stuck, CUT_WITHIN)
        server.watch.stop()

    asyncio.run(main())


def test_a_callers_own_cancellation_is_not_turned_into_a_server_error(caplog):
    async def main() -> None:
        server = ForgetfulServer()
        server.watch.start()
        task = asyncio.ensure_future(server.generate())
        await server.watched_for(0.03)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        server.dead = True
        await server.watched_for(0.05)  # the watch finds nothing left to cut
        server.watch.stop()

    with caplog.at_level(logging.WARNING):
        asyncio.run(main())
    assert not [r for r in caplog.records if "failed over" in r.getMessage()]


def test_a_request_in_a_batch_task_gets_the_error_so_the_batch_completes():
    """generate_batch runs each request in its own task and waits for all: a cut request must come
    back as an error (not vanish as a cancelled task), or the batch waits forever."""
    from agentloop.servers.base import GenerateBatcher

    class Batched(ForgetfulServer):
        # what agentloop's servers do: a GenerateBatcher part
        async def generate_batch(self, requests):
            async for group in GenerateBatcher(self.generate).run(requests):
                yield group

    async def main() -> list:
        server = Batched()
        server.watch.start()

        async def kill_soon() -> None:
            await asyncio.sleep(0.05)
            server.dead = True

        async def collect() -> list:
            return [
                item
                async for group in server.generate_batch([{"seconds": 0.0}, {}, {}])
                for item in group
            ]

        killer = asyncio.ensure_future(kill_soon())
        got = await asyncio.wait_for(collect(), CUT_WITHIN)
        await killer
        server.watch.stop()
        return sorted(got, key=lambda x: x[0])

    got = asyncio.run(main())
    assert got[0] == (0, "done")
    assert all(isinstance(r, ServerDeadError) for _, r in got[1:])


class HangingServer(ForgetfulServer):
    """An engine that is alive but may stop making progress (a hung collective, a stopped process).

    While ``progressing``, it has sampled a token between any two looks of the watch, however far
    apart."""

    def __init__(self, stall_timeout: float | None = 0.1) -> None:
        super().__init__()
        self.tokens = 0
        self.progressing = False
        self.held = False
        self.stopped: list[str] = []
        self.watch = EngineWatch(
            self.is_dead, interval=0.01, progress=self.progress, stall_timeout=stall_timeout,
            holding=lambda: self.held, on_stall=self.stopped.append,
        )

    def progress(self) -> int:
        if self.progressing:
            self.tokens += 1
        return self.tokens


def test_an_engine_without_progress_is_taken_for_hung_and_its_requests_fail_over():
    async def main() -> None:
        server = HangingServer(stall_timeout=0.1)
        server.watch.start()
        stuck = asyncio.ensure_future(server.generate())
        server.progressing = True
        await server.watched_for(0.4)  # slower than the timeout in all, but progressing: not hung
        assert not stuck.done() and server.watch.stalled is None
        server.progressing = False
        with pytest.raises(ServerDeadError):
            await asyncio.wait_for(stuck, CUT_WITHIN)  # progress stopped: cut after ~0.1 s
        assert server.watch.stalled is not None and "no progress" in server.watch.stalled
        assert server.stopped == [server.watch.stalled]  # the hung engine is stopped once
        server.watch.stop()

    asyncio.run(main())


def test_no_stall_without_running_requests_while_held_or_when_disabled():
    async def main() -> None:
        idle = HangingServer(stall_timeout=0.05)
        idle.watch.start()
        await idle.watched_for(0.2)  # nothing running: an idle engine makes no progress and is fine
        assert idle.watch.stalled is None

        held = HangingServer(stall_timeout=0.05)
        held.held = True  # paused / a weight update open: the server itself holds its requests
        held.watch.start()
        waiting = asyncio.ensure_future(held.generate())
        await held.watched_for(0.2)
        assert not waiting.done() and held.watch.stalled is None
        held.held = False  # released, and still no progress: now it is a hang
        with pytest.raises(ServerDeadError):
            await asyncio.wait_for(waiting, CUT_WITHIN)

        off = HangingServer(stall_timeout=None)  # rollout.server.stall_timeout: null
        off.watch.start()
        forever = asyncio.ensure_future(off.generate())
        await off.watched_for(0.2)
        assert not forever.done() and off.watch.stalled is None
        forever.cancel()
        for s in (idle, held, off):
            s.watch.stop()

    asyncio.run(main())


def test_engine_progress_reads_vllm_request_states():
    from types import SimpleNamespace

    from agentloop.cluster.enginewatch import engine_progress

    def state(n: int) -> SimpleNamespace:
        return SimpleNamespace(detokenizer=SimpleNamespace(num_output_tokens=lambda: n))

    engine = SimpleNamespace(
        output_processor=SimpleNamespace(request_states={"a": state(3), "b": state(5)})
    )
    assert engine_progress(engine) == (2, 8)
    assert engine_progress(SimpleNamespace()) is None  # a vLLM without it: no stall detection
    assert engine_progress(None) is None


def test_outside_a_ray_actor_a_hung_engine_kills_none_of_the_callers_processes():
    import subprocess
    import sys

    from agentloop.cluster.enginewatch import kill_engine_processes

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert kill_engine_processes() == []
        assert child.poll() is None  # still running: not a server actor's engine
    finally:
        child.kill()
        child.wait()
