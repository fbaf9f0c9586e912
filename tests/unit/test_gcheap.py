"""Actors freeze their start-up heap (no full-GC pauses mid-rollout) and raise the young
generation's threshold; drivers and test processes are never touched."""

from __future__ import annotations

import gc

from omegaconf import OmegaConf

from agentloop.utils import gcheap


def test_outside_a_ray_actor_nothing_is_frozen(monkeypatch):
    froze: list[bool] = []
    monkeypatch.setattr(gc, "freeze", lambda: froze.append(True))
    before = gc.get_threshold()
    assert not gcheap.in_ray_actor()
    assert gcheap.freeze_startup_heap(OmegaConf.create({"gc_freeze": True})) == 0
    assert froze == [] and gc.get_threshold() == before


def test_in_an_actor_the_heap_is_frozen_unless_the_config_says_no(monkeypatch):
    froze: list[bool] = []
    monkeypatch.setattr(gcheap, "in_ray_actor", lambda: True)
    monkeypatch.setattr(gc, "freeze", lambda: froze.append(True))
    monkeypatch.setattr(gc, "get_freeze_count", lambda: 123)
    assert gcheap.freeze_startup_heap(OmegaConf.create({"gc_freeze": False})) == 0 and froze == []
    # on by default
    assert gcheap.freeze_startup_heap(OmegaConf.create({})) == 123 and froze == [True]


def test_in_an_actor_the_young_generation_is_collected_less_often(monkeypatch):
    monkeypatch.setattr(gcheap, "in_ray_actor", lambda: True)
    monkeypatch.setattr(gc, "freeze", lambda: None)
    before = gc.get_threshold()
    try:
        gcheap.freeze_startup_heap(OmegaConf.create({}))  # 50,000 by default
        assert gc.get_threshold() == (50_000, *before[1:])  # the older generations keep theirs
        gc.set_threshold(*before)
        gcheap.freeze_startup_heap(OmegaConf.create({"gc_threshold": None}))  # CPython's kept
        assert gc.get_threshold() == before
    finally:
        gc.set_threshold(*before)
