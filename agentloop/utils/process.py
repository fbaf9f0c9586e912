"""Process utilities: an actor's CPU priority, and child processes started off the event loop.

:func:`restore_normal_priority` is called by every actor that does real work (servers, workers,
gateways) when it starts.  :func:`start_process` / :func:`wait_process` run a child (an agent
command of the ``openai_agent`` loop) in its own process group without blocking or forking from the
event loop's thread; a caller that gives up (a timeout, a cancellation) never leaves the child
running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO

__all__ = ["restore_normal_priority", "spawn_process", "start_process", "wait_process"]

logger = logging.getLogger(__name__)


def restore_normal_priority(normal_priority: bool) -> str:
    """Give this actor's threads nice 0 again unless ``normal_priority``
    (``rollout.normal_priority``, :attr:`agentloop.config.EngineConfig.normal_priority`) is false.

    Ray starts every worker process (so every actor) at nice 15 (``RAY_worker_niceness``) and the
    engine processes an actor spawns inherit it, so an engine sharing cores with anything at normal
    priority gets ~1/28 of its neighbours' share (vLLM run by hand runs at nice 0).  Lowering
    niceness needs root or CAP_SYS_NICE; without them a warning says how to get the same effect when
    starting the cluster.

    Args:
        normal_priority: False leaves the priority as it is.

    Returns:
        What happened, for the start-up report (e.g. ``"nice 15 -> 0"``).
    """
    if not normal_priority:
        return "unchanged (rollout.normal_priority=false)"
    before = os.getpriority(os.PRIO_PROCESS, 0)
    if before <= 0:
        return f"nice {before}"
    try:
        for tid in os.listdir("/proc/self/task"):  # nice is per thread on Linux
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, int(tid), 0)
    except (PermissionError, FileNotFoundError) as e:
        logger.warning(
            "this actor (pid %d) runs at nice %d (Ray's default for actors) and could not "
            "reset it (%s); it "
            "and any engine it starts get less CPU than processes at normal priority. Start "
            "Ray with "
            "RAY_worker_niceness=0 in the environment (e.g. `RAY_worker_niceness=0 ray "
            "start ...`) or set "
            "actor_rollout_ref.rollout.normal_priority=false to silence this.",
            os.getpid(),
            before,
            e,
        )
        return f"nice {before} (could not reset: {e})"
    return f"nice {before} -> 0"


_SPAWN_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="agentloop-spawn")
"""Threads that start child processes (``Popen`` forks there, never on the event loop's thread)."""
_POLL_MAX_S = 0.05


def spawn_process(
    argv: list[str], env: dict[str, str], stderr: IO[bytes] | int
) -> subprocess.Popen:
    """``Popen`` in a new session, stdin and stdout closed; :func:`start_process` calls it in a
    spawn thread (tests replace this module attribute to make a spawn hang)."""
    return subprocess.Popen(
        argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
        start_new_session=True,
    )


def _kill(proc: subprocess.Popen) -> None:
    """Kill the child's whole process group (it runs in its own session), then reap it off the
    loop."""
    with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, OSError):
        proc.kill()
    _SPAWN_POOL.submit(proc.wait)


def _kill_when_spawned(future: Future) -> None:
    """Done-callback of a spawn the caller stopped waiting for: kill the process if it did start
    (runs in the spawn thread, so it works even after the event loop is gone)."""
    if not future.cancelled() and future.exception() is None:
        _kill(future.result())


async def start_process(
    argv: list[str], env: dict[str, str], stderr: IO[bytes]
) -> subprocess.Popen:
    """Start ``argv`` with :func:`spawn_process` in a spawn thread.

    Returns:
        The started process.

    Raises:
        asyncio.CancelledError: the caller was cancelled (it never waits for a hanging spawn); a
        process
            that starts after that is killed.
    """
    future = _SPAWN_POOL.submit(spawn_process, argv, env, stderr)
    try:
        return await asyncio.shield(asyncio.wrap_future(future))
    except asyncio.CancelledError:
        future.add_done_callback(_kill_when_spawned)
        raise


async def wait_process(proc: subprocess.Popen) -> int:
    """Wait for ``proc`` by polling from the event loop (no thread held per child).

    Returns:
        Its exit code.

    Raises:
        asyncio.CancelledError: the caller was cancelled; the process group is killed first.
    """
    delay = 0.001
    try:
        while (code := proc.poll()) is None:
            await asyncio.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        return code
    except asyncio.CancelledError:
        _kill(proc)
        raise
