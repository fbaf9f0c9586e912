"""Keep Python's full garbage collections off the rollout path of long-lived actors.

:func:`freeze_startup_heap` calls ``gc.freeze()`` once an actor has started (unless
``actor_rollout_ref.rollout.gc_freeze`` is false, and only inside a Ray actor,
:func:`in_ray_actor`), so the ~415k start-up objects of torch, transformers and the tokenizer leave
CPython's full collections (a rare ~0.2 s pause each); objects created later are collected as
before.  The price: reference cycles among the frozen start-up objects are never freed.  Returns how
many objects were frozen. Measurements: docs/benchmarks.md (Full garbage collections).
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
    """In a Ray actor whose start-up is done: collect once, then freeze every tracked object.

    Args:
        rollout: the :class:`EngineConfig` (``gc_freeze``), or the ``actor_rollout_ref.rollout``
        mapping.

    Returns how many objects are frozen (0 when off, or outside an actor: freezing a test process or
    a user's driver would be a surprise).
    """
    engine = rollout if isinstance(rollout, EngineConfig) else EngineConfig.from_rollout(rollout)
    if not engine.gc_freeze or not in_ray_actor():
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
