"""Mid-batch looks for hung actors: ServerSupervisor.watch and WorkerPool.watch_workers (Ray
faked out)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
import ray

import agentloop.utils.hangwatch as hangwatch_module
from agentloop.cluster.placement import ServerGroup
from agentloop.cluster.supervisor import ServerSupervisor
from agentloop.servers.base import ServerDeadError


@dataclass(eq=False)
class Ref:
    """A pending call: ``answer`` is None while it runs, else the value (or exception) it ends
    with."""

    method: str
    answer: Any = None


@dataclass
class Method:
    server: FakeServer
    name: str

    def remote(self, *args: Any, **kwargs: Any) -> Ref:
        ref = Ref(self.name)
        self.server.sent.append(ref)
        if not self.server.hung:
            ref.answer = self.server.reply
        return ref


@dataclass(eq=False)
class FakeServer:
    name: str
    hung: bool = False
    reply: Any = "ok"
    sent: list[Ref] = field(default_factory=list)

    def __getattr__(self, method: str) -> Method:
        return Method(self, method)


@dataclass
class Group(ServerGroup):
    can: bool = True
    relaunched: list[int] = field(default_factory=list)

    @property
    def restartable(self) -> bool:
        return self.can

    def relaunch(self, index: int) -> Any:
        self.relaunched.append(index)
        return FakeServer(f"restarted{index}")


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    killed: list[Any] = []

    def get(ref: Ref, timeout: float | None = None) -> Any:
        if ref.answer is None:
            raise TimeoutError("no answer")
        if isinstance(ref.answer, BaseException):
            raise ref.answer
        return ref.answer

    monkeypatch.setattr(hangwatch_module.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns=1, timeout=None: (
        [r for r in refs if r.answer is not None], [r for r in refs if r.answer is None]))
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart=True: killed.append(handle))
    return now, killed


def make(servers: list[FakeServer], *, restart: bool = True) -> tuple[ServerSupervisor, Group]:
    group = Group(list(servers), None, "cpu", [], can=restart)
    return ServerSupervisor(group, None, lambda i, h: None), group


def test_a_server_that_answers_its_probes_is_left_alone_however_long_the_batch(clock):
    now, killed = clock
    servers = [FakeServer("a"), FakeServer("b")]
    sup, group = make(servers)
    for _ in range(10):
        assert sup.watch(hang_s=5) == []
        now[0] += 3
    assert not killed and not sup.down and not group.relaunched
    # one per look
    assert all(
        len(s.sent) == 10 and {r.method for r in s.sent} == {"check_health"} for s in servers
    )


def test_a_probe_unanswered_for_the_hang_time_kills_and_restarts_the_server_without_asking_it(
    clock,
):
    now, killed = clock
    servers = [FakeServer("a"), FakeServer("b", hung=True)]
    sup, group = make(servers)
    assert sup.watch(hang_s=5) == []
    now[0] += 4.9
    assert sup.watch(hang_s=5) == []  # not yet
    assert len(servers[1].sent) == 1  # one probe in flight at a time, not one per look
    now[0] += 0.1
    assert sup.watch(hang_s=5) == [1]
    assert sup.down == {1} and sup.counts["servers_hung"] == 1
    assert killed == [servers[1]] and group.relaunched == [1] and 1 in sup.restarting
    # no shutdown sent to a hung actor
    assert [r.method for r in servers[1].sent] == ["check_health"]
    now[0] += 60
    assert sup.watch(hang_s=5) == []  # restarting: not probed


def test_a_hung_server_that_cannot_be_restarted_is_still_killed_so_its_requests_fail_over(clock):
    now, killed = clock
    servers = [FakeServer("a", hung=True)]
    sup, group = make(servers, restart=False)
    sup.watch(hang_s=1)
    now[0] += 1
    assert sup.watch(hang_s=1) == [0]
    assert killed == [servers[0]] and sup.down == {0} and not group.relaunched


def test_a_probe_that_says_the_engine_died_takes_the_server_out_at_once(clock):
    _, killed = clock
    servers = [FakeServer("a", reply=ServerDeadError("a: the engine process died"))]
    sup, group = make(servers)
    assert sup.watch(hang_s=300) == [0]
    assert sup.counts["servers_hung"] == 0 and group.relaunched == [0]
    # a live actor is asked first
    assert [r.method for r in servers[0].sent] == ["check_health", "shutdown"]


def test_another_error_is_left_to_the_check_after_the_batch(clock):
    servers = [FakeServer("a", reply=ValueError("odd"))]
    sup, _ = make(servers)
    assert sup.watch(hang_s=300) == [] and not sup.down


def test_a_probe_left_in_flight_between_batches_is_judged_by_its_answer_not_the_gap(clock):
    now, killed = clock
    servers = [FakeServer("a", hung=True), FakeServer("b", hung=True)]
    sup, _ = make(servers)
    sup.watch(hang_s=5)  # the batch ends with both probes in flight
    servers[0].sent[0].answer = "ok"  # a answered during the trainer's step; b never did
    now[0] += 600
    assert sup.watch(hang_s=5) == [1] and killed == [servers[1]]


def test_a_failure_of_an_actor_already_replaced_does_not_restart_its_replacement(clock):
    """The Rollouter's thread took a hung server out; the trainer's pause() then sees its call to
    the old actor fail.  The replacement, still starting, must not be killed and started again."""
    now, killed = clock
    servers = [FakeServer("a", hung=True), FakeServer("b")]
    sup, group = make(servers)
    sup.watch(hang_s=1)
    now[0] += 1
    assert sup.watch(hang_s=1) == [0]
    replacement = sup.restarting[0].handle
    sup.lose(0, "died during pause: actor died", handle=servers[0])
    assert (
        sup.restarting[0].handle is replacement
        and group.relaunched == [0]
        and killed == [servers[0]]
    )
    # the replacement itself failing counts
    sup.lose(0, "died during begin_weight_update", handle=replacement)
    assert group.relaunched == [0, 0] and replacement in killed


def test_the_watch_stays_out_of_a_weight_update(clock):
    now, killed = clock
    sup, _ = make([FakeServer("a", hung=True)])
    sup.updating = True
    sup.watch(hang_s=1)
    now[0] += 10
    assert sup.watch(hang_s=1) == [] and not killed and not sup.down


def test_a_worker_that_leaves_a_ping_unanswered_is_killed_and_says_why(clock):
    from agentloop.rollout.dispatcher import Dispatcher
    from agentloop.rollout.worker_slots import WorkerSlot

    now, killed = clock
    pool = Dispatcher(spawn=lambda i, w: None, num_workers=3, error_rows=lambda *a: None, hang_s=3)
    fine, blocked, starting = (
        FakeServer("w0"), FakeServer("w1", hung=True), FakeServer("w2", hung=True),
    )
    slots = [
        WorkerSlot(0, fine, "a"), WorkerSlot(1, blocked, "b"),
        WorkerSlot(2, starting, "c", ready=Ref("ready")),
    ]
    assert pool.watch_workers(slots) == []
    now[0] += 2.9
    assert pool.watch_workers(slots) == []
    now[0] += 0.1
    assert pool.watch_workers(slots) == [slots[1]]
    assert killed == [blocked] and pool.fault_counts["workers_hung"] == 1
    assert "unanswered for 3 s (agent.stall_timeout)" in slots[1].hung
    # one ping; a starting one: none
    assert [r.method for r in blocked.sent] == ["ping"] and starting.sent == []
    assert len(fine.sent) == 3
    now[0] += 60
    assert pool.watch_workers(slots) == []  # already killed: not killed again before it is replaced


def test_a_gateway_that_stops_answering_is_killed_so_its_sessions_end(clock):
    from agentloop.gateway.actor import kill_hung_gateways
    from agentloop.utils.hangwatch import HangWatch

    now, killed = clock
    gateways = [FakeServer("g0"), FakeServer("g1", hung=True)]
    watch: HangWatch[int] = HangWatch()
    told: list[tuple[int, str, int]] = []

    def tell(index: int, reason: str) -> None:
        told.append((index, reason, len(killed)))

    assert kill_hung_gateways(gateways, watch, 5, tell=tell) == [] and told == []
    now[0] += 5
    assert kill_hung_gateways(gateways, watch, 5, tell=tell) == [1]
    assert killed == [gateways[1]] and {r.method for g in gateways for r in g.sent} == {
        "num_sessions"
    }
    # the workers hear why before the kill, so the rows of the sessions on it can say so
    assert (
        [(i, n) for i, _, n in told] == [(1, 0)]
        and "hung" in told[0][1]
        and "stall_timeout" in told[0][1]
    )


def test_sessions_on_a_gateway_killed_as_hung_fail_with_the_reason():
    """GatewayManager: calls for sessions on a gateway the manager killed say why, not only that the
    actor died; a gateway that merely died still raises Ray's error, and no new session is opened on
    either."""
    from ray.exceptions import RayActorError

    from agentloop.errors import ServerError
    from agentloop.gateway.actor import GatewayManager

    class Gone:
        def __init__(self, name: str) -> None:
            self.name = name
            self.opened = 0

        async def create_session(self, session_id=None, metadata=None, sampling_params=None):
            self.opened += 1
            return type("Handle", (), {"session_id": f"{self.name}-{self.opened}"})()

        async def finalize(self, session_id, longest_only=False):
            raise RayActorError()

        abort = complete = finalize

    async def scenario() -> None:
        gm = GatewayManager([Gone("a"), Gone("b")])
        first, second = await gm.create_session(), await gm.create_session()
        gm.lost(
            0,
            "hung: it left a probe unanswered for 5 s (rollout.server.stall_timeout) "
            "and was killed",
        )
        with pytest.raises(ServerError, match="gateway 0 hung: .*stall_timeout"):
            await gm.abort(first.session_id)
        with pytest.raises(RayActorError):
            await gm.finalize(second.session_id)
        third = await gm.create_session()
        assert third.session_id.startswith("b-") and gm.gateways[0].opened == 1

    asyncio.run(scenario())
