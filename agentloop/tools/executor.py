"""Where synchronous tool code runs, so that it never blocks the agent loops' event loop.

Sync ``@function_tool`` functions and plain-``def`` ``BaseTool`` methods run in the process's
:class:`ToolExecutor` (:func:`tool_executor`): a pool of ``multi_turn.tool_max_workers`` daemon
threads, or, with ``multi_turn.tool_executor: process``, a ``spawn`` process pool for sync function
tools (which must be importable by name: :func:`function_reference` raises
:class:`~agentloop.errors.ConfigError` otherwise, when the tools load).  Timeouts are the caller's
``asyncio.wait_for``; a timed-out call runs on and keeps its slot.  Spec:
docs/tools.md#the-tool-executor.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import importlib
import importlib.util
import multiprocessing
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from agentloop.config.build import read_value
from agentloop.config.checks import EXECUTOR_KINDS, check_tool_executor, check_tool_max_workers
from agentloop.errors import ConfigError

__all__ = [
    "DEFAULT_MAX_WORKERS", "EXECUTOR_KINDS", "FunctionRef", "ToolExecutor", "call_ref",
    "configure_tool_executor", "function_reference", "shutdown_tool_executor", "tool_executor",
]

DEFAULT_MAX_WORKERS: int = read_value(None, "actor_rollout_ref.rollout.multi_turn.tool_max_workers")
"""The pool size before the tool agent loop configures one (``multi_turn.tool_max_workers``'s
default)."""
_FILE_MODULE_PREFIX = "_agentloop_function_tools_"  # modules made by load_function_tools_from_path


class _DaemonThreadPool(Executor):
    """A bounded pool of daemon threads (a hung call never blocks interpreter exit, unlike
    ThreadPoolExecutor)."""

    def __init__(self, max_workers: int) -> None:
        self._max_workers = max_workers
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...],
                                             dict[str, Any]] | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the tool thread pool is shut down")
            self._queue.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max_workers:
                thread = threading.Thread(
                    target=self._work, name=f"agentloop-tool-{len(self._threads)}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            del item
            if future.set_running_or_notify_cancel():  # False: cancelled (timed out) while queued
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
                    future.set_exception(e)
            del future, fn, args, kwargs
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._queue.put(None)
        if wait:
            for thread in threads:
                thread.join()


@dataclass(frozen=True)
class FunctionRef:
    """How a fresh process finds a tool function: ``module`` + ``qualname`` (+ the file of a
    ``function_tool_path`` module, which is not importable by name)."""

    module: str
    qualname: str
    path: str | None = None
    direct: bool = False
    """The module attribute is the function itself (pickled by reference; the pool process need not
    import agentloop); otherwise a decorated function reached through its tool class, or a file
    module."""


def function_reference(fn: Callable[..., Any], label: str) -> FunctionRef:
    """The :class:`FunctionRef` of ``fn``; ConfigError (naming ``label``) when a fresh process
    could not find it."""
    fix = ("define it at the top level of a module (or of the function_tool_path file), or set "
           "actor_rollout_ref.rollout.multi_turn.tool_executor=thread")
    module_name = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module_name or not qualname or "<" in qualname:
        raise ConfigError(
            f"{label} cannot run in the tool process pool: {qualname or fn!r} "
            f"is a lambda or is "
            f"defined inside a function; {fix}"
        )
    module = sys.modules.get(module_name)
    path = (
        getattr(module, "__file__", None) if module_name.startswith(_FILE_MODULE_PREFIX) else None
    )
    if module is None or (module_name == "__main__" and not getattr(module, "__file__", None)):
        raise ConfigError(
            f"{label} cannot run in the tool process pool: its module "
            f"{module_name!r} cannot be "
            f"imported by a new process; {fix}"
        )
    ref = FunctionRef(module_name, qualname, path)
    try:
        found = _resolve(ref)
    except AttributeError:
        found = None
    if found is fn:
        return FunctionRef(
            module_name, qualname, path, direct=path is None and _attribute(module, qualname) is fn
        )
    raise ConfigError(
        f"{label} cannot run in the tool process pool: "
        f"{module_name}.{qualname} does not name "
        f"this function (it was replaced or renamed after definition); {fix}"
    )


def _resolve(ref: FunctionRef) -> Callable[..., Any]:
    """The function ``ref`` names, importing its module (or running its file) when needed."""
    module = sys.modules.get(ref.module)
    if module is None:
        if ref.path is not None:
            spec = importlib.util.spec_from_file_location(ref.module, ref.path)
            assert spec is not None and spec.loader is not None, ref.path
            module = importlib.util.module_from_spec(spec)
            sys.modules[ref.module] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(ref.module)
    obj = _attribute(module, ref.qualname)
    # @function_tool replaces the module's function by its tool class; the function is the class's
    # ``fn``.
    fn = getattr(obj, "fn", None) if isinstance(obj, type) else None
    return fn if callable(fn) else obj  # type: ignore[no-any-return]


def _attribute(module: Any, qualname: str) -> Any:
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def call_ref(ref: FunctionRef, kwargs: dict[str, Any]) -> Any:
    """Call the function ``ref`` names with ``kwargs`` (what a pool process runs): its module is
    taken from ``sys.modules``, run from ``ref.path`` or imported by name; a ``@function_tool``
    class stands for its ``fn``. Returns what the function returns; raises what it raises."""
    return _resolve(ref)(**kwargs)


class ToolExecutor:
    """Runs synchronous tool code off the event loop (docs/tools.md#the-tool-executor).

    Args:
        kind: ``thread`` or ``process`` (``process`` applies to sync ``@function_tool`` functions;
        other
            sync tool code still runs in threads).
        max_workers: the pool's size.
    """

    def __init__(self, kind: str = "thread", max_workers: int = DEFAULT_MAX_WORKERS) -> None:
        check_tool_executor(kind)
        check_tool_max_workers(max_workers)
        self.kind = kind
        self.max_workers = max_workers
        self._threads: _DaemonThreadPool | None = None
        self._processes: ProcessPoolExecutor | None = None
        self._refs: dict[Callable[..., Any], FunctionRef] = {}
        self._lock = threading.Lock()

    def check_function(self, fn: Callable[..., Any], label: str) -> None:
        """Raise ConfigError now if ``fn`` could not run where :meth:`run_function` would send
        it."""
        if self.kind == "process":
            self._refs[fn] = function_reference(fn, label)

    async def run_function(
        self, fn: Callable[..., Any], kwargs: dict[str, Any], label: str = "tool"
    ) -> Any:
        """``fn(**kwargs)`` in the pool of this executor's kind (a sync ``@function_tool``
        function)."""
        if self.kind != "process":
            return await self.run_in_thread(fn, **kwargs)
        ref = self._refs.get(fn) or function_reference(fn, label)
        pool = self._process_pool()
        try:
            future = pool.submit(fn, **kwargs) if ref.direct else pool.submit(call_ref, ref, kwargs)
            return await asyncio.wrap_future(future)
        except BrokenProcessPool as e:
            self._drop_process_pool(pool)
            raise RuntimeError(
                f"a tool process died while running {label} (killed, or "
                f"crashed the interpreter); "
                "the pool was restarted for later calls"
            ) from e

    async def run_in_thread(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in the thread pool, in a copy of the caller's context (as
        ``asyncio.to_thread``)."""
        with self._lock:
            if self._threads is None:
                self._threads = _DaemonThreadPool(self.max_workers)
            pool = self._threads
        context = contextvars.copy_context()
        return await asyncio.wrap_future(
            pool.submit(context.run, functools.partial(fn, *args, **kwargs))
        )

    def _process_pool(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._processes is None:
                self._processes = ProcessPoolExecutor(
                    self.max_workers, mp_context=multiprocessing.get_context("spawn")
                )
            return self._processes

    def _drop_process_pool(self, pool: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._processes is pool:
                self._processes = None
        pool.shutdown(wait=False, cancel_futures=True)

    def shutdown(self, terminate: bool = True) -> None:
        """Stop the pools: idle threads exit (busy ones when their call returns); processes are
        terminated (with ``terminate``) or left to finish their current call."""
        with self._lock:
            threads, processes = self._threads, self._processes
            self._threads = self._processes = None
        if threads is not None:
            threads.shutdown(wait=False)
        if processes is not None:
            for process in (
                list((getattr(processes, "_processes", None) or {}).values()) if terminate else []
            ):
                if process.is_alive():
                    process.terminate()
            processes.shutdown(wait=False, cancel_futures=True)


_current: ToolExecutor | None = None
_current_lock = threading.Lock()


def tool_executor() -> ToolExecutor:
    """The executor of this process (a thread pool of :data:`DEFAULT_MAX_WORKERS` until
    configured)."""
    global _current
    with _current_lock:
        if _current is None:
            _current = ToolExecutor()
        return _current


def configure_tool_executor(
    kind: str = "thread", max_workers: int = DEFAULT_MAX_WORKERS
) -> ToolExecutor:
    """Make ``ToolExecutor(kind, max_workers)`` this process's executor (kept as is when it already
    is one).

    Called once per worker by the tool agent loop from ``multi_turn.tool_executor`` /
    ``tool_max_workers``. A replaced executor is shut down; calls already running in it finish
    there.
    """
    global _current
    new = ToolExecutor(kind, max_workers)
    with _current_lock:
        old = _current
        if old is not None and (old.kind, old.max_workers) == (kind, max_workers):
            return old
        _current = new
    if old is not None:
        old.shutdown(terminate=False)
    return new


def shutdown_tool_executor() -> None:
    """Shut this process's executor down (a later call starts a default one)."""
    global _current
    with _current_lock:
        old, _current = _current, None
    if old is not None:
        old.shutdown()
