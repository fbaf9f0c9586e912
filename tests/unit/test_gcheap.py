"""Actors freeze their start-up heap (no full-GC pauses mid-rollout); drivers and test processes
never do."""

from __future__ import annotations

import gc

from omegaconf import OmegaConf

from agentloop.utils import gcheap


def test_outside_a_ray_actor_nothing_is_frozen(monkeypatch):
    froze: list[bool] = []
    monkeypatch.setattr(gc, "freeze", lambda: froze.append(True))
    assert not gcheap.in_ray_actor()
    assert gcheap.freeze_startup_heap(OmegaConf.create({"gc_freeze": True})) == 0
    assert froze == []


def test_in_an_actor_the_heap_is_frozen_unless_the_config_says_no(monkeypatch):
    froze: list[bool] = []
    monkeypatch.setattr(gcheap, "in_ray_actor", lambda: True)
    monkeypatch.setattr(gc, "freeze", lambda: froze.append(True))
    monkeypatch.setattr(gc, "get_freeze_count", lambda: 123)
    assert gcheap.freeze_startup_heap(OmegaConf.create({"gc_freeze": False})) == 0 and froze == []
    # on by default
    assert gcheap.freeze_startup_heap(OmegaConf.create({})) == 123 and froze == [True]
