"""verl's ``verl.utils.profiler`` timers, for loops that time their phases into ``metrics``.

verl 0.6.1 and 0.9.1 agree on the semantics, and so does this module:

* the elapsed wall time is measured in **seconds** (``time.perf_counter``);
* it is **added** to ``timing_raw[name]`` (created at 0.0), so timing one phase twice accumulates;
* when the block raises, nothing is added (the exception propagates).

``marked_timer`` is verl's timer that also emits NVTX / MSTX range markers when those profilers are
available; agentloop has no device profiler, so it times exactly like ``simple_timer`` and ignores
the marker arguments.  verl's trainer-side profiler names (``DistProfiler``, ``GPUMemoryLogger``,
...) are not provided; importing one raises an ImportError that says so.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager

from agentloop.compat.import_map import MissingVerlNameError, missing_verl_name

__all__ = ["marked_timer", "simple_timer"]


@contextmanager
def simple_timer(name: str, timing_raw: MutableMapping[str, float]) -> Iterator[None]:
    """Add the seconds spent in the ``with`` block to ``timing_raw[name]``.

    Example (verl's tool agent loop times each phase into the metrics it returns)::

        with simple_timer("generate_sequences", metrics):
            output = await self.server_manager.generate(...)
    """
    start = time.perf_counter()
    yield
    timing_raw[name] = timing_raw.get(name, 0.0) + (time.perf_counter() - start)


@contextmanager
def marked_timer(
    name: str, timing_raw: MutableMapping[str, float], color: str | None = None,
    domain: str | None = None, category: str | None = None,
) -> Iterator[None]:
    """:func:`simple_timer` with verl's marker arguments (``color``, ``domain``, ``category``),
    which are ignored."""
    with simple_timer(name, timing_raw):
        yield


def __getattr__(name: str) -> object:
    if name.startswith("__"):
        raise AttributeError(name)
    raise MissingVerlNameError(missing_verl_name("verl.utils.profiler", name))
