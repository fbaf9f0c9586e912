"""BucketedLeastInFlight (make_balancer's choice from 32 servers on) routes exactly as the
scanning LeastInFlight."""

from __future__ import annotations

import random

import pytest

from agentloop.routing.strategies import (
    Balancer,
    BucketedLeastInFlight,
    LeastInFlight,
    StickySession,
    make_balancer,
)


def _pair(servers: int, tie_break: str) -> tuple[Balancer, Balancer]:
    scan = Balancer(servers, StickySession(LeastInFlight(tie_break, seed=7), 1 << 20))
    bucketed = Balancer(servers, StickySession(BucketedLeastInFlight(tie_break, seed=7), 1 << 20))
    return scan, bucketed


@pytest.mark.parametrize("tie_break", ["random", "rotate"])
@pytest.mark.parametrize("servers", [1, 3, 64, 256])
def test_same_choices_through_acquires_releases_owners_and_faults(
    servers: int, tie_break: str
) -> None:
    scan, bucketed = _pair(servers, tie_break)
    rng = random.Random(servers)
    held: list[tuple[int, str]] = []
    for step in range(4000):
        op = rng.random()
        if op < 0.5 or not held:
            rid = f"r{rng.randrange(3000)}"  # repeats: sticky hits
            owner = f"w{rng.randrange(4)}"
            a, b = scan.acquire(rid, 10, owner=owner), bucketed.acquire(rid, 10, owner=owner)
            assert a == b, f"step {step}: {a} != {b}"
            held.append((a, owner))
        elif op < 0.9:
            server, owner = held.pop(rng.randrange(len(held)))
            scan.release(server, owner=owner)
            bucketed.release(server, owner=owner)
        elif op < 0.93:
            owner = f"w{rng.randrange(4)}"
            assert scan.release_owner(owner) == bucketed.release_owner(owner)
            held = [(s, o) for s, o in held if o != owner]
        elif op < 0.97 and sum(scan.healthy) > 1:
            down = rng.randrange(servers)
            scan.mark_down(down)
            bucketed.mark_down(down)
        else:
            up = rng.randrange(servers)
            scan.mark_up(up)
            bucketed.mark_up(up)
        assert scan.in_flight == bucketed.in_flight


def test_the_buckets_follow_the_counts() -> None:
    least = BucketedLeastInFlight("rotate")
    balancer = Balancer(4, least)
    for rid in ("a", "b", "c", "d", "e"):
        balancer.acquire(rid)
    assert balancer.in_flight == [2, 1, 1, 1]
    balancer.release(0)
    balancer.release(0)
    assert least.choose(None, balancer.in_flight) == 0  # type: ignore[arg-type]  # the only server at 0


def test_make_balancer_buckets_from_32_servers() -> None:
    assert isinstance(make_balancer(8).strategy.fallback, LeastInFlight)  # type: ignore[attr-defined]
    assert not isinstance(make_balancer(8).strategy.fallback, BucketedLeastInFlight)  # type: ignore[attr-defined]
    assert isinstance(make_balancer(256).strategy.fallback, BucketedLeastInFlight)  # type: ignore[attr-defined]
