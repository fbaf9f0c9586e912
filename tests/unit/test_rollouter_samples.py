"""The Rollouter dispatches and counts a group's samples one by one (``per_sample``, the default): a
sample that ended frees its place in ``max_inflight`` while its group waits for its siblings, and a
group is handed out only once all of its samples are in.  The dispatcher is a stand-in on a virtual
clock (each sample takes a set time; a dispatched unit ends with its slowest sample)."""

from __future__ import annotations

import heapq
import itertools
from typing import Any

import numpy as np
import pytest

from agentloop.batch.protocol import DataProto
from agentloop.rollout.dispatcher import Finished, Group
from agentloop.rollout.rollouter import Rollouter
from agentloop.rollout.worker import WorkerStats


class SimDispatch:
    """One streaming call: units sent together, each finishing on its own."""

    def __init__(self, units: list[Group], version: int) -> None:
        self.groups, self.version, self.finished = units, version, set()

    def unfinished(self) -> list[Group]:
        return [u for i, u in enumerate(self.groups) if i not in self.finished]


class SimRun:
    """A DispatchRun stand-in: ``durations[index]`` seconds per sample on a virtual clock;
    ``versions``: (virtual time, weight version) switches."""

    def __init__(self, durations: dict[int, float], versions: list[tuple[float, int]]) -> None:
        self.durations, self.versions = durations, versions
        self.now = 0.0
        self.open: list[SimDispatch] = []
        self.ends: list[tuple[float, int, SimDispatch, int]] = []
        self.order = itertools.count()
        self.dispatched: list[int] = []
        """Sample indexes in dispatch order (a re-run appears again)."""
        self.peak = 0

    @property
    def version(self) -> int:
        return max((v for t, v in self.versions if t <= self.now), default=0)

    @property
    def dispatches(self) -> list[SimDispatch]:
        return list(self.open)

    def inflight(self) -> int:
        return sum(len(u.rows) for d in self.open for u in d.unfinished())

    def submit(self, units: list[Group], global_steps: int | None = None) -> SimDispatch:
        dispatch = SimDispatch(units, self.version)
        self.open.append(dispatch)
        for local, unit in enumerate(units):
            index = unit.rows.non_tensor_batch["index"].tolist()
            self.dispatched += index
            end = self.now + max(self.durations[i] for i in index)
            heapq.heappush(self.ends, (end, next(self.order), dispatch, local))
        self.peak = max(self.peak, self.inflight())
        return dispatch

    def poll(self, timeout: float | None = None) -> list[Finished]:
        while self.ends:
            end, _, dispatch, local = heapq.heappop(self.ends)
            if dispatch in self.open:
                break
        else:
            return []
        self.now = end
        dispatch.finished.add(local)
        if not dispatch.unfinished():
            self.open.remove(dispatch)
        unit = dispatch.groups[local]
        rows = DataProto(
            None,
            {**unit.rows.non_tensor_batch,
             "min_global_steps": np.array([dispatch.version] * len(unit.rows), dtype=object)},
            {"reward_extra_keys": []},
        )
        return [Finished(unit, rows, WorkerStats(0, [{"i": i} for i in range(len(rows))]),
                         dispatch.version)]

    def cancel(self, dispatch: SimDispatch) -> list[Group]:
        self.open.remove(dispatch)
        return dispatch.unfinished()

    def take_retries(self) -> list[Group]:
        return []

    def look_if_due(self) -> None:
        pass

    def close(self) -> None:
        pass


class SimManager:
    """What the Rollouter reads of an AgentLoopManager; the weight version follows the clock."""

    server_handles: list[Any] = []

    def __init__(self, run: SimRun) -> None:
        self.run = run
        self.workers = self

    def open(self) -> SimRun:
        return self.run

    @property
    def weight_version(self) -> int:
        return self.run.version

    def prepare(self, batch: DataProto) -> DataProto:
        return batch

    def grow_sticky_cache(self, n: int) -> None:
        pass

    def engine_busy_seconds(self) -> list[float]:
        return []


def batches(num: int, groups: int, n: int) -> list[DataProto]:
    """``num`` prompt batches of ``groups`` uids x ``n`` rows (rows of a uid adjacent)."""
    out = []
    for b in range(num):
        index = np.arange(b * groups * n, (b + 1) * groups * n)
        uid = np.array([f"u{i // n}" for i in index], dtype=object)
        out.append(DataProto(None, {"index": index, "uid": uid}, {"global_steps": 0}))
    return out


def heavy_tail(count: int, seed: int = 0) -> dict[int, float]:
    rng = np.random.default_rng(seed)
    return {i: float(d) for i, d in enumerate(rng.lognormal(0.0, 1.0, count))}


def roll_out(per_sample: bool, durations: dict[int, float], versions=(), **kw: Any):
    run = SimRun(durations, list(versions))
    rollouter = Rollouter(
        SimManager(run), batches(4, 8, 4), max_inflight=32, groups_per_dispatch=1,
        per_sample=per_sample, **kw,
    )
    parts = list(iter(lambda: rollouter.get(num_groups=8, timeout=30), None))
    rollouter.stop()
    for part in parts:  # each hand-out's own snapshot
        del part.meta_info["rollouter"]
    return run, rollouter, parts


@pytest.mark.parametrize("per_sample", [True, False])
def test_every_group_is_handed_out_once_whole_within_the_budget(per_sample: bool) -> None:
    run, rollouter, parts = roll_out(per_sample, heavy_tail(128))
    assert run.peak <= 32
    rows = DataProto.concat(parts)
    uids = rows.non_tensor_batch["uid"].tolist()
    assert sorted(rows.non_tensor_batch["index"].tolist()) == list(range(128))
    # each group's four rows together, in their batch order, with one metrics dict per row
    for start in range(0, 128, 4):
        assert len(set(uids[start:start + 4])) == 1
        index = rows.non_tensor_batch["index"][start:start + 4].tolist()
        assert index == sorted(index) and index[0] % 4 == 0
    assert all(len(p.meta_info["metrics"]["i"]) == len(p) for p in parts)
    assert rollouter.counts["groups_handed_out"] == rollouter.counts["groups_done"] == 32
    assert sorted(run.dispatched) == list(range(128))  # nothing ran twice


def test_a_finished_sample_frees_its_place_at_once() -> None:
    durations = heavy_tail(128)
    group_run, _, _ = roll_out(False, durations)
    sample_run, _, _ = roll_out(True, durations)
    # the same budget, kept full: the whole rollout ends sooner
    assert sample_run.now < 0.85 * group_run.now
    # the per-sample Rollouter starts samples of later groups while a group's straggler runs
    first = sample_run.dispatched.index(32)
    assert first < 64 and group_run.dispatched.index(32) == 32


def test_stale_samples_are_rolled_out_again_and_no_group_lags_more_than_max_staleness() -> None:
    # sample 3 spans two weight switches (t=5, t=6): it comes back two versions behind
    durations = {i: 1.0 for i in range(128)}
    durations[3] = 10.0
    run, rollouter, parts = roll_out(
        True, durations, versions=[(5.0, 1), (6.0, 2)], max_staleness=1
    )
    assert run.dispatched.count(3) >= 2
    rows = DataProto.concat(parts)
    assert sorted(rows.non_tensor_batch["index"].tolist()) == list(range(128))
    assert max(rollouter.staleness) <= 1
    assert rollouter.counts["groups_rerun_stale"] >= 1


def test_a_group_stale_when_handed_out_reruns_only_its_stale_samples() -> None:
    # one group: samples 0-2 end at t=1 (version 0); sample 3 ends at t=10 two versions behind and
    # is re-run alone; at hand-out (version 2) samples 0-2 are too stale: only they run again
    durations = {0: 1.0, 1: 1.0, 2: 1.0, 3: 10.0}
    run = SimRun(durations, [(5.0, 1), (6.0, 2)])
    rollouter = Rollouter(
        SimManager(run), batches(1, 1, 4), max_inflight=4, max_staleness=1, per_sample=True
    )
    part = rollouter.get(num_groups=1, timeout=30)
    rollouter.stop()
    assert sorted(run.dispatched) == [0, 0, 1, 1, 2, 2, 3, 3]  # sample 3 not a third time
    assert part.non_tensor_batch["index"].tolist() == [0, 1, 2, 3]
    assert part.non_tensor_batch["min_global_steps"].tolist() == [2, 2, 2, 2]
    assert rollouter.staleness == {0: 1} and len(part.meta_info["metrics"]) == 4


def test_per_sample_is_the_default_only_without_a_staleness_bound() -> None:
    manager = SimManager(SimRun({}, []))
    assert Rollouter(manager, [], max_inflight=4).per_sample
    assert not Rollouter(manager, [], max_inflight=4, max_staleness=1).per_sample
    assert Rollouter(manager, [], max_inflight=4, max_staleness=1, per_sample=True).per_sample
