"""The dispatcher with Ray faked out: generate_sequences' path (Dispatcher.run) and the Rollouter
share one dead-worker path (same error-row text, same retry count), and groups come back once each.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import ray
import ray.exceptions

from agentloop.batch.protocol import DataProto
from agentloop.rollout.dispatcher import Dispatcher, Group, split_groups
from agentloop.rollout.rollouter import Rollouter
from agentloop.rollout.worker import WorkerStats
from agentloop.types import RolloutStatus


class Value:
    """An ObjectRef stand-in: ``ray.get`` returns the value or raises the error."""

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error

    def get(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class Stream:
    """A Ray streaming generator stand-in over what a worker yields: ``(group, rows, stats)`` per
    group, in order; a dying worker's stream raises an actor error instead."""

    def __init__(self, batch: DataProto, starts: list[int], dies: bool) -> None:
        bounds = [*starts, len(batch)]
        self.items = (
            [Value(error=ray.exceptions.RayActorError())]
            if dies
            else [
                Value(
                    (
                        g, rolled_out(batch.slice(bounds[g], bounds[g + 1])),
                        WorkerStats(0, [{}] * (bounds[g + 1] - bounds[g])),
                    )
                )
                for g in range(len(starts))
            ]
        )

    def __next__(self) -> Value:
        if not self.items:
            raise StopIteration
        return self.items.pop(0)


class FakeWorker:
    """An AgentLoopWorker actor handle; ``dies``: its streams end with an actor error (the actor
    is dead)."""

    def __init__(self, dies: bool, loses_frames: bool = False) -> None:
        self.dies, self.loses_frames = dies, loses_frames
        self.streams: list[list[Any]] = []

    def __getattr__(self, name: str) -> Any:
        worker = self

        class Method:
            def options(self, **_: Any) -> Method:
                return self

            def remote(self, *args: Any, **kwargs: Any) -> Any:
                if name == "generate_sequences_stream":
                    batch, starts = args
                    worker.streams.append(batch.non_tensor_batch["index"].tolist())
                    if worker.loses_frames and "channel_token" in kwargs:
                        return iter(())  # "sent" every group on the channel; none arrives
                    return Stream(batch, starts, worker.dies)
                if name == "connect_results":  # reachable only for a worker that loses frames
                    return Value(worker.loses_frames)
                return Value({})

        return Method()


def rolled_out(prompts: DataProto) -> DataProto:
    return DataProto(None, {"index": prompts.non_tensor_batch["index"],
                            "status": np.array(["stop"] * len(prompts), dtype=object),
                            "error": np.array([None] * len(prompts), dtype=object)}, {})


def error_rows(chunk: DataProto, status: RolloutStatus, message: str) -> DataProto:
    return DataProto(
        None,
        {
            "index": chunk.non_tensor_batch["index"],
            "status": np.array([status.value] * len(chunk), dtype=object),
            "error": np.array([message] * len(chunk), dtype=object),
        },
        {"metrics": [{}] * len(chunk)},
    )


@pytest.fixture
def fake_ray(monkeypatch):
    def get(refs: Any, timeout: float | None = None) -> Any:
        return [r.get() for r in refs] if isinstance(refs, list) else refs.get()

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(
        ray,
        "wait",
        lambda refs, num_returns=1, timeout=None: (
            list(refs)[:num_returns],
            list(refs)[num_returns:],
        ),
    )
    monkeypatch.setattr(ray, "kill", lambda *a, **k: None)
    monkeypatch.setattr(ray, "cancel", lambda *a, **k: None)


def make_dispatcher(retries: int, all_die: bool = False) -> tuple[Dispatcher, list[FakeWorker]]:
    """Two workers; the first one spawned dies on its first stream (``all_die``: every one does)."""
    spawned: list[FakeWorker] = []

    def spawn(index: int, worker_id: str) -> FakeWorker:
        spawned.append(FakeWorker(dies=all_die or not spawned))
        return spawned[-1]

    dispatcher = Dispatcher(
        spawn=spawn, num_workers=2, error_rows=error_rows, max_sample_retries=retries
    )
    dispatcher.start()
    return dispatcher, spawned


def prompts(n: int) -> DataProto:
    return DataProto(
        None,
        {"index": np.arange(n), "uid": np.array([f"u{i // 2}" for i in range(n)], dtype=object)},
        {"global_steps": 0},
    )


def roll_out_with_the_rollouter(dispatcher: Dispatcher, batch: DataProto) -> DataProto:
    manager = type(
        "Manager",
        (),
        {
            "workers": dispatcher, "weight_version": 0, "server_handles": [],
            "prepare": staticmethod(lambda b: b), "grow_sticky_cache": staticmethod(lambda n: None),
            "engine_busy_seconds": staticmethod(lambda: []),
        },
    )()
    # uid groups of 2, two groups a dispatch: rows 0-3 on the first worker, 4-7 on the second (as
    # Dispatcher.run)
    rollouter = Rollouter(manager, [batch], max_inflight=len(batch), groups_per_dispatch=2)
    parts = list(iter(lambda: rollouter.get(num_groups=len(batch), timeout=30), None))
    rollouter.stop()
    out = DataProto.concat([DataProto(p.batch, p.non_tensor_batch, {}) for p in parts])
    return out.select_idxs(np.argsort(out.non_tensor_batch["index"]))


@pytest.mark.parametrize("retries", [0, 1])
def test_generate_sequences_and_the_rollouter_handle_a_dead_worker_the_same_way(fake_ray, retries):
    runs = {}
    for path in ("generate_sequences", "rollouter"):
        dispatcher, spawned = make_dispatcher(retries)
        batch = prompts(8)
        if path == "generate_sequences":
            out = DataProto.concat(
                [DataProto(None, p.rows.non_tensor_batch, {}) for p in dispatcher.run(batch)]
            )
        else:
            out = roll_out_with_the_rollouter(dispatcher, batch)
        runs[path] = (out, dict(dispatcher.fault_counts), spawned)
    (sync, sync_counts, sync_workers), (rollouter, async_counts, async_workers) = runs.values()
    assert (
        sync.non_tensor_batch["index"].tolist()
        == rollouter.non_tensor_batch["index"].tolist()
        == list(range(8))
    )
    assert sync.non_tensor_batch["status"].tolist() == rollouter.non_tensor_batch["status"].tolist()
    assert sync.non_tensor_batch["error"].tolist() == rollouter.non_tensor_batch["error"].tolist()
    failed = [e for e in sync.non_tensor_batch["error"].tolist() if e]
    if retries == 0:
        assert failed and all(
            e.startswith("the agent-loop worker running this sample died (")
            and e.endswith("and agent.max_sample_retries=0 retries were used")
            for e in failed
        )
        assert sync_counts["sample_retries"] == async_counts["sample_retries"] == 0
    else:
        assert not failed  # rolled out again on the other worker
        assert sync_counts["sample_retries"] == async_counts["sample_retries"] > 0
    assert sync_counts == async_counts and sync_counts["worker_restarts"] == 1
    assert len(sync_workers) == len(async_workers) == 3  # the dead one was replaced


def test_a_group_survives_only_max_sample_retries_deaths(fake_ray):
    dispatcher, spawned = make_dispatcher(retries=1, all_die=True)
    groups = [Group(rows, key=i) for i, rows in enumerate(split_groups(prompts(4), "uid"))]
    done = list(dispatcher.stream(groups))
    assert sorted(f.group.key for f in done) == [0, 1]  # each group exactly once
    assert all(f.fault and "max_sample_retries=1 retries were used" in f.fault for f in done)
    assert (
        dispatcher.fault_counts["samples_failed_by_faults"] == 4
        and dispatcher.fault_counts["sample_retries"] == 4
    )
    # each dead worker replaced once
    assert dispatcher.fault_counts["worker_restarts"] == len(spawned) - 2 >= 2


def _on_last_calls(monkeypatch: pytest.MonkeyPatch) -> tuple[int, list[tuple[int, int]]]:
    """Roll 8 rows out over 2 healthy workers; returns the number of groups and, per ``on_last``
    call, how many groups had been waited for and fetched by then."""
    spawned: list[FakeWorker] = []
    dispatcher = Dispatcher(spawn=lambda i, w: spawned.append(FakeWorker(False)) or spawned[-1],
                            num_workers=2, error_rows=error_rows)
    dispatcher.start()
    fetched: list[int] = []
    waited: list[int] = []
    get, wait = ray.get, ray.wait

    def counting_get(refs: Any, timeout: float | None = None) -> Any:
        out = get(refs, timeout)
        if isinstance(out, tuple):
            fetched.append(out[0])
        return out

    def counting_wait(refs: Any, **kwargs: Any) -> Any:
        ready, rest = wait(refs, **kwargs)
        waited.extend([0] * len(ready))
        return ready, rest

    monkeypatch.setattr(ray, "get", counting_get)
    monkeypatch.setattr(ray, "wait", counting_wait)
    fired: list[tuple[int, int]] = []
    parts = dispatcher.run(prompts(8), on_last=lambda: fired.append((len(waited), len(fetched))))
    groups = dispatcher.chunks_per_worker * 2
    assert len(parts) == groups
    return groups, fired


def test_on_last_fires_once_before_the_last_group_is_fetched(fake_ray, monkeypatch):
    """generate_sequences sends its servers' health probes through ``on_last``: once, when only one
    group is left out, before its rows are fetched (no worker dies here)."""
    groups, fired = _on_last_calls(monkeypatch)
    assert fired == [(groups - 1, groups - 1)]  # before the wait for the last group


def test_on_last_fires_again_when_the_early_call_is_stale(fake_ray, monkeypatch):
    """The first ``on_last`` (one group left out) stands for the last one only while fresh: when
    the last group comes later than ``ON_LAST_FRESH_S``, the servers are probed again before it is
    fetched (a server dying meanwhile is seen in this batch's check)."""
    from agentloop.rollout import dispatcher as dispatcher_module

    monkeypatch.setattr(dispatcher_module, "ON_LAST_FRESH_S", -1.0)  # every early call is stale
    groups, fired = _on_last_calls(monkeypatch)
    # once when the last group is the only one out, again when it is ready (not fetched yet)
    assert fired == [(groups - 1, groups - 1), (groups, groups - 1)]


def test_on_last_fires_again_when_a_fault_reran_groups_after_it(fake_ray):
    dispatcher, _ = make_dispatcher(retries=1)
    fired: list[dict[str, int]] = []
    out = dispatcher.run(prompts(8), on_last=lambda: fired.append(dict(dispatcher.fault_counts)))
    assert sum(len(p.rows) for p in out) == 8
    assert fired and fired[-1] == dispatcher.fault_counts  # the last probe saw every fault


def test_with_a_result_channel_no_worker_can_reach_the_rows_come_through_the_streams(fake_ray):
    spawned: list[FakeWorker] = []

    def spawn(index: int, worker_id: str) -> FakeWorker:
        spawned.append(FakeWorker(dies=False))
        return spawned[-1]

    dispatcher = Dispatcher(spawn=spawn, num_workers=2, error_rows=error_rows,
                            result_channel="tcp")
    dispatcher.start()
    # the channel is closed again and no replacement will try it
    assert dispatcher.channel is None and dispatcher.pool.on_ready == []
    parts = dispatcher.run(prompts(8))
    rows = DataProto.concat([p.rows for p in parts])
    assert rows.non_tensor_batch["index"].tolist() == list(range(8))
    assert set(rows.non_tensor_batch["status"]) == {"stop"}


def test_groups_whose_channel_frames_never_arrive_run_again(fake_ray, monkeypatch):
    from agentloop.rollout import dispatch_channel
    from agentloop.rollout import dispatcher as dispatcher_module

    monkeypatch.setattr(dispatch_channel, "CHANNEL_GRACE_S", 0.2)
    monkeypatch.setattr(dispatcher_module, "CONNECT_WAIT_S", 0.1)
    spawned: list[FakeWorker] = []

    def spawn(index: int, worker_id: str) -> FakeWorker:
        spawned.append(FakeWorker(dies=False, loses_frames=not spawned))  # the first one only
        return spawned[-1]

    dispatcher = Dispatcher(spawn=spawn, num_workers=2, error_rows=error_rows,
                            result_channel="tcp", max_sample_retries=1)
    dispatcher.start()
    try:
        assert dispatcher.channel is not None  # the first worker "connected"
        parts = dispatcher.run(prompts(8))
    finally:
        dispatcher.shutdown()
    rows = DataProto.concat([p.rows for p in parts])
    assert rows.non_tensor_batch["index"].tolist() == list(range(8))
    assert set(rows.non_tensor_batch["status"]) == {"stop"}  # rolled out again, not lost
    assert dispatcher.fault_counts["sample_retries"] == 4 and dispatcher.fault_counts[
        "worker_restarts"] == 1  # its worker is taken for broken and replaced


def test_on_part_gives_each_range_once_with_its_first_row(fake_ray):
    """``run(on_part=...)`` (the manager copies each range into the batch as it comes): every range
    once, a dead worker's included, with the input row it starts at."""
    dispatcher, _ = make_dispatcher(retries=1)
    seen: list[tuple[int, list[int]]] = []
    parts = dispatcher.run(
        prompts(8), on_part=lambda first, f: seen.append(
            (first, f.rows.non_tensor_batch["index"].tolist()))
    )
    assert sorted(first for first, _ in seen) == [0, 2, 4, 6]
    assert all(rows == list(range(first, first + 2)) for first, rows in seen)
    assert len(seen) == len(parts) == 4
