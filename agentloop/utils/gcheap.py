"""Keep Python's full garbage collections off the rollout path of long-lived actors.

An agent-loop worker actor holds ~415k GC-tracked objects once it has imported torch and transformers and
loaded a tokenizer (a vLLM server actor's front end is of the same kind).  CPython's oldest-generation
collection walks all of them (~0.2 s measured in a worker on our CPU machines) whenever enough objects have
survived younger collections: rarely, but then a pause of the order of a whole short GPU batch
(docs/benchmarks.md).  ``gc.freeze()`` after start-up moves those objects to the permanent generation, which
collections skip; objects created later are collected as before, and frozen objects whose reference count
drops to zero are still freed.  The price: reference cycles among the frozen start-up objects are never freed.
vLLM's engine core does the same in its own process after it starts.
``actor_rollout_ref.rollout.gc_freeze: false`` turns it off.
"""

from __future__ import annotations

import gc
from typing import Any


def in_ray_actor() -> bool:
    """True inside a Ray actor process (not the driver, not a plain test process)."""
    try:
        import ray

        return bool(ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None)
    except Exception:  # noqa: BLE001 - no Ray, or no runtime context: not an actor
        return False


def freeze_startup_heap(rollout: Any) -> int:
    """In a Ray actor whose start-up is done: collect once, then freeze every tracked object.

    Returns how many objects are frozen (0 when off, or outside an actor: freezing a test process or a user's
    driver would be a surprise).
    """
    if not rollout.get("gc_freeze", True) or not in_ray_actor():
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
