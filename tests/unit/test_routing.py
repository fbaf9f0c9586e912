"""Router behaviour: sticky sessions, least in-flight spreading, release on every exit, no tie
pinning."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from ray.exceptions import RayActorError

from agentloop.errors import RoutingError, ServerError
from agentloop.routing import (
    AsyncLLMServerManager,
    LeastInFlight,
    RouteContext,
    StickySession,
    make_balancer,
)
from agentloop.testing import ScriptedServer
from agentloop.types import TokenOutput


def servers(n: int, delay: float = 0.0) -> list[ScriptedServer]:
    return [ScriptedServer(lambda ids, p, rid: [1, 2], delay=delay, name=f"s{i}") for i in range(n)]


def test_sticky_turns_of_interleaved_requests_hit_one_server():
    srv = servers(3)
    mgr = AsyncLLMServerManager(srv)

    async def conversation(rid: str) -> set[int]:
        used = set()
        for _ in range(4):
            out = await mgr.generate(rid, prompt_ids=[1, 2, 3], sampling_params={})
            used.add(out.extra_fields["server_index"])
            await asyncio.sleep(0)
        return used

    async def main():
        return await asyncio.gather(*(conversation(f"r{i}") for i in range(12)))

    results = asyncio.run(main())
    assert all(len(u) == 1 for u in results)
    for i, s in enumerate(srv):  # the server index recorded is the one that served the calls
        assert all(
            c["request_id"] in {f"r{j}" for j, u in enumerate(results) if u == {i}} for c in s.calls
        )


def test_least_in_flight_spreads_concurrent_requests_evenly():
    srv = servers(4, delay=0.05)
    mgr = AsyncLLMServerManager(srv)

    async def main():
        return await asyncio.gather(
            *(mgr.generate(f"r{i}", prompt_ids=[1], sampling_params={}) for i in range(8))
        )

    outs = asyncio.run(main())
    assert Counter(o.extra_fields["server_index"] for o in outs) == {0: 2, 1: 2, 2: 2, 3: 2}
    assert mgr.balancer.in_flight == [0, 0, 0, 0]


def test_in_flight_released_on_error_and_cancellation():
    bad = ScriptedServer([RuntimeError("boom")])
    slow = ScriptedServer(lambda ids, p, rid: [1], delay=10)
    mgr = AsyncLLMServerManager([bad])
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(mgr.generate("a", prompt_ids=[1], sampling_params={}))
    assert mgr.balancer.in_flight == [0]

    mgr2 = AsyncLLMServerManager([slow])

    async def cancel_it():
        task = asyncio.create_task(mgr2.generate("b", prompt_ids=[1], sampling_params={}))
        await asyncio.sleep(0.01)
        assert mgr2.balancer.in_flight == [1]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_it())
    assert mgr2.balancer.in_flight == [0]


def test_ties_do_not_pin_to_first_server():
    mgr = AsyncLLMServerManager(servers(4))

    async def main():
        return [
            (await mgr.generate(f"seq{i}", prompt_ids=[1], sampling_params={})).extra_fields[
                "server_index"
            ]
            for i in range(40)
        ]

    used = Counter(asyncio.run(main()))
    assert set(used) == {0, 1, 2, 3}
    assert max(used.values()) < 25


def test_rotate_tie_break_cycles():
    lif = LeastInFlight(tie_break="rotate")
    picks = [lif.choose(RouteContext(f"r{i}"), [0, 0, 0]) for i in range(6)]
    assert sorted(Counter(picks).values()) == [2, 2, 2]


def test_lru_evicts_oldest_request_id():
    sticky = StickySession(LeastInFlight(seed=0), max_cache_size=2)
    for rid in ("a", "b", "c"):
        sticky.choose(RouteContext(rid), [0, 0])
    assert (
        sticky.lookup("a") is None
        and sticky.lookup("b") is not None
        and sticky.lookup("c") is not None
    )


def test_lru_hit_refreshes_order_and_forget_unbinds():
    sticky = StickySession(LeastInFlight(seed=0), max_cache_size=2)
    sticky.choose(RouteContext("a"), [0, 0])
    sticky.choose(RouteContext("b"), [0, 0])
    sticky.choose(RouteContext("a"), [0, 0])  # "a" is now the most recent
    sticky.choose(RouteContext("c"), [0, 0])  # evicts "b", not "a"
    assert sticky.lookup("a") is not None and sticky.lookup("b") is None
    sticky.forget("a")
    assert sticky.lookup("a") is None


def test_balancer_counts_and_never_goes_below_zero():
    bal = make_balancer(2, seed=1)
    first = bal.acquire("x")
    assert bal.acquire("x") == first  # sticky even while in flight
    assert bal.stats() == {"in_flight": [2 if i == first else 0 for i in range(2)],
                           "routed": [2 if i == first else 0 for i in range(2)], "healthy": [1, 1]}
    for _ in range(3):
        bal.release(first)
    assert bal.in_flight == [0, 0]


def test_dead_server_becomes_server_error_and_releases():
    mgr = AsyncLLMServerManager([ScriptedServer([RayActorError()])])
    with pytest.raises(ServerError, match="server 0 died .* request gone"):
        asyncio.run(mgr.generate("gone", prompt_ids=[1], sampling_params={}))
    assert mgr.balancer.in_flight == [0]
    assert mgr.down == {0} and mgr.balancer.healthy == [False]


def test_server_index_is_added_on_a_copy():
    shared = TokenOutput(token_ids=[1], extra_fields={"k": "v"})
    mgr = AsyncLLMServerManager([ScriptedServer([shared])])
    out = asyncio.run(mgr.generate("r", prompt_ids=[1], sampling_params={}))
    assert out.extra_fields == {"k": "v", "server_index": 0}
    assert shared.extra_fields == {"k": "v"}


def test_manager_rejects_no_servers_and_foreign_indices():
    with pytest.raises(RoutingError, match="no servers"):
        AsyncLLMServerManager([])
    mgr = AsyncLLMServerManager(servers(1), make_balancer(3, seed=0))
    mgr.balancer.in_flight[0] = 5  # force the balancer to pick a server this manager lacks
    with pytest.raises(RoutingError, match="num_servers"):
        asyncio.run(mgr.generate("r", prompt_ids=[1], sampling_params={}))
    assert mgr.balancer.in_flight[1:] == [0, 0]


def test_balancer_errors_are_clear():
    with pytest.raises(RoutingError, match="no servers"):
        make_balancer(0)
    bal = make_balancer(2)
    with pytest.raises(RoutingError, match="out of range"):
        bal.release(5)


def test_abort_goes_to_the_bound_server():
    srv = servers(2)
    mgr = AsyncLLMServerManager(srv)

    async def main():
        out = await mgr.generate("x", prompt_ids=[1], sampling_params={})
        await mgr.abort("x")
        return out.extra_fields["server_index"]

    idx = asyncio.run(main())
    assert srv[idx].counts["abort"] == 1 and srv[1 - idx].counts["abort"] == 0


class _FakeActorMethod:
    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def remote(self, *args):
        self.calls.append(args)

        async def run():
            await asyncio.sleep(0.01)
            return self.fn(*args)

        return run()


class _FakeBalancerHandle:
    """Stands in for the GlobalBalancer actor handle: same methods, counts round trips."""

    def __init__(self, num_servers: int):
        from agentloop.routing.balancer_actor import BalancerActor

        self.actor = BalancerActor(num_servers, seed=0)
        self.calls: list = []
        self.acquire_many = _FakeActorMethod(self.actor.acquire_many, self.calls)


def test_remote_balancer_batches_round_trips_and_releases():
    from agentloop.routing.balancer_actor import RemoteBalancer

    handle = _FakeBalancerHandle(2)
    client = RemoteBalancer(handle)

    async def main():
        servers = await asyncio.gather(*(client.acquire(f"r{i}") for i in range(50)))
        for s in servers:
            client.release(s)
        await asyncio.sleep(0.05)
        return servers

    servers = asyncio.run(main())
    assert Counter(servers) == {0: 25, 1: 25}
    assert len(handle.calls) <= 3, (
        "50 acquires and 50 releases should take a few round trips, not 100"
    )
    assert handle.actor.balancer.in_flight == [0, 0]


def test_remote_balancer_releases_a_slot_whose_waiter_was_cancelled():
    from agentloop.routing.balancer_actor import RemoteBalancer

    handle = _FakeBalancerHandle(1)
    client = RemoteBalancer(handle)

    async def main():
        task = asyncio.create_task(client.acquire("gone"))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.sleep(0.05)

    asyncio.run(main())
    assert handle.actor.balancer.in_flight == [0]


class _FakeServerHandle:
    """Stands in for a server actor handle: records each Ray call as it is submitted."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.generate = self._Method(self, "generate")
        self.generate_batch = self._Method(self, "generate_batch")

    class _Method:
        def __init__(self, owner: _FakeServerHandle, name: str) -> None:
            self.owner, self.name = owner, name

        def options(self, **_: object) -> _FakeServerHandle._Method:
            return self

        def remote(self, *args: object, **kwargs: object) -> object:
            if self.name == "generate":
                self.owner.calls.append([str(kwargs["request_id"])])
                reply = TokenOutput(token_ids=[len(self.owner.calls)], stop_reason="stop")
                return asyncio.sleep(0, result=reply)
            requests = args[0]
            self.owner.calls.append([str(r["request_id"]) for r in requests])  # type: ignore[index]

            async def stream():  # one streamed group with every result
                group = [
                    (i, TokenOutput(token_ids=[i], stop_reason="stop"))
                    for i in range(len(requests))
                ]  # type: ignore[arg-type]
                yield asyncio.sleep(0, result=group)

            return stream()


def test_batcher_sends_a_full_batch_at_once_and_the_rest_at_the_end_of_the_iteration():
    """Requests leave in calls of at most max_batch, the full ones before the caller yields to the
    loop (so the engine starts on them while the caller prepares the rest); each caller gets its own
    result."""
    from agentloop.routing.batcher import ServerCallBatcher

    async def go() -> None:
        handle = _FakeServerHandle()
        batcher = ServerCallBatcher(handle, 0, max_batch=4)
        futures = [batcher.submit({"request_id": f"r{i}", "prompt_ids": [1]}) for i in range(10)]
        # not yet yielded
        assert handle.calls == [["r0", "r1", "r2", "r3"], ["r4", "r5", "r6", "r7"]]
        results = await asyncio.gather(*futures)
        assert handle.calls[2:] == [["r8", "r9"]]
        assert [r.token_ids for r in results] == [[0], [1], [2], [3]] * 2 + [[0], [1]]
        assert (batcher.num_calls, batcher.num_requests) == (3, 10)
        # a lone request: plain generate
        lone = await batcher.submit({"request_id": "solo", "prompt_ids": [1]})
        assert handle.calls[-1] == ["solo"] and lone.token_ids == [4]

    asyncio.run(go())
