"""The sticky request-id -> server cache at batch scale: bindings of samples still running are
not evicted."""

from __future__ import annotations

from agentloop.routing.strategies import make_balancer


def route_all(balancer, ids):
    return {rid: balancer.acquire(rid) for rid in ids}


def test_a_batch_larger_than_max_cache_size_keeps_every_binding_once_the_cache_is_grown():
    ids = [f"sample-{i}" for i in range(100_000)]
    small = make_balancer(8, max_cache_size=10_000, seed=0)
    route_all(small, ids)
    # verl's fixed LRU: the first 90% of a 100k batch lost their server
    assert small.lookup(ids[0]) is None

    grown = make_balancer(8, max_cache_size=10_000, seed=0)
    assert grown.ensure_cache_capacity(2 * len(ids)) == 200_000
    first = route_all(grown, ids)
    assert all(grown.lookup(rid) == server for rid, server in first.items())
    # a second turn of every sample goes back to its server (its prefix cache)
    assert all(grown.acquire(rid) == server for rid, server in first.items())


def test_the_capacity_never_shrinks_below_the_configured_floor():
    balancer = make_balancer(4, max_cache_size=10_000)
    assert balancer.ensure_cache_capacity(100) == 10_000
    assert balancer.ensure_cache_capacity(50_000) == 50_000
    assert balancer.ensure_cache_capacity(20_000) == 50_000
