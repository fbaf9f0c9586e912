"""Kill a Ray actor and wait until it is gone.

``ray.kill`` returns before the actor is dead: a call issued right after it (a health check, a
generate) can still be answered.  A test that asserts what happens *after* a death waits here first.
"""

from __future__ import annotations

import time
from typing import Any

import ray
import ray.exceptions


def kill_and_wait(actor: Any, method: str = "check_health", timeout: float = 30.0) -> None:
    """``ray.kill(actor)``, then call ``actor.<method>()`` until Ray says the actor died."""
    ray.kill(actor)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get(getattr(actor, method).remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError(f"{actor} still answers {timeout} s after ray.kill")
