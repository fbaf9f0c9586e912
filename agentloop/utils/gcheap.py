"""Keep Python's garbage collector off the rollout path of long-lived actors.

:func:`freeze_startup_heap` runs once an actor has started (only inside a Ray actor,
:func:`in_ray_actor`):

* ``gc.freeze()`` (``actor_rollout_ref.rollout.gc_freeze``): the ~415k start-up objects of torch,
  transformers and the tokenizer leave CPython's full collections (a rare ~0.2 s pause each);
  objects created later are collected as before.  The price: reference cycles among the frozen
  start-up objects are never freed.
* the young generation's threshold (``rollout.gc_threshold``, default 50,000; CPython's is 700):
  a batch makes ~100 tracked objects per row that live until it is padded, so with CPython's
  threshold a 256-row batch runs ~36 young and ~4 middle collections that walk them again and
  again (~4-5 µs of a single-turn row's ~65 µs in ``scripts/bench_stack.py``).  Unreachable cycles
  wait longer to be freed (50,000 new objects at most, a few MB); the older generations' thresholds
  are CPython's.

Measurements: docs/benchmarks.md (Full garbage collections; the ninth pass).
"""

from __future__ import annotations

import gc
from typing import Any

import ray

from agentloop.config import EngineConfig


def in_ray_actor() -> bool:
    """True inside a Ray actor process (not the driver, not a plain test process)."""
    try:
        return bool(ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None)
    except Exception:  # noqa: BLE001 - no Ray, or no runtime context: not an actor
        return False


def freeze_startup_heap(rollout: EngineConfig | Any) -> int:
    """In a Ray actor whose start-up is done: collect once, then freeze every tracked object; set
    the young generation's threshold (:func:`tune_collector`).

    Args:
        rollout: the :class:`EngineConfig` (``gc_freeze``, ``gc_threshold``), or the
        ``actor_rollout_ref.rollout`` mapping.

    Returns how many objects are frozen (0 when off, or outside an actor: tuning a test process or
    a user's driver would be a surprise).
    """
    if not in_ray_actor():
        return 0
    return tune_collector(rollout)


def tune_collector(rollout: EngineConfig | Any) -> int:
    """What :func:`freeze_startup_heap` does in an actor, in this process whatever it is (for a
    benchmark that measures a worker as its actor runs it): ``gc_freeze`` collects once and freezes
    every tracked object; ``gc_threshold`` (not null) becomes the young generation's threshold.
    Returns how many objects are frozen."""
    engine = rollout if isinstance(rollout, EngineConfig) else EngineConfig.from_rollout(rollout)
    if engine.gc_threshold is not None:
        _, middle, old = gc.get_threshold()
        gc.set_threshold(engine.gc_threshold, middle, old)
    if not engine.gc_freeze:
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
