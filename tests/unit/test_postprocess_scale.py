"""postprocess (preallocated, filled in place) equals a row-by-row reference on random ragged
batches, and the faster LeastInFlight makes the same choices as the straightforward list scan it
replaced."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from agentloop.batch.postprocess import postprocess
from agentloop.routing.strategies import Balancer, LeastInFlight, RouteContext, StickySession
from agentloop.types import AgentLoopOutput

PAD = 7


def reference(
    outputs: list[AgentLoopOutput], P: int, R: int, log_probs: bool
) -> dict[str, list[list[float]]]:
    """The layout built one row at a time with plain lists (docs/concepts.md#the-output-layout)."""
    cols: dict[str, list[list[float]]] = {
        k: []
        for k in (
            "prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids",
            "rollout_log_probs", "rollout_weight_versions",
        )
    }
    for o in outputs:
        prompt = list(o.prompt_ids)[-P:] if P else []
        resp, mask = list(o.response_ids)[:R], list(o.response_mask)[:R]
        cols["prompts"].append([PAD] * (P - len(prompt)) + prompt)
        cols["responses"].append(resp + [PAD] * (R - len(resp)))
        cols["response_mask"].append(mask + [0] * (R - len(mask)))
        cols["input_ids"].append(cols["prompts"][-1] + cols["responses"][-1])
        attention = (
            [0] * (P - len(prompt)) + [1] * (len(prompt) + len(resp)) + [0] * (R - len(resp))
        )
        cols["attention_mask"].append(attention)
        running, positions = 0, []
        for a in attention:
            running += a
            positions.append(max(running - 1, 0))
        cols["position_ids"].append(positions)
        lp = list(o.response_logprobs or [])[:R] if log_probs else []
        cols["rollout_log_probs"].append(lp + [0.0] * (R - len(lp)))
        wv = list(o.response_weight_versions or [])[:R]
        cols["rollout_weight_versions"].append(wv + [-1] * (R - len(wv)))
    return cols


def random_outputs(rng: random.Random, n: int, P: int, R: int, *, with_logprobs: float,
                   with_versions: bool) -> list[AgentLoopOutput]:
    outs = []
    for _ in range(n):
        n_prompt = rng.choice([0, 1, P, P + 3, rng.randint(0, P + 5)])
        # empty responses are common
        n_resp = rng.choice([0, 0, 1, R, R + 4, rng.randint(0, R + 5)])
        ids = [rng.randrange(100_000) for _ in range(n_resp)]
        outs.append(
            AgentLoopOutput(
                prompt_ids=[rng.randrange(100_000) for _ in range(n_prompt)],
                response_ids=ids,
                response_mask=[rng.randint(0, 1) for _ in ids],
                response_logprobs=[-rng.random() * 5 for _ in ids]
                if rng.random() < with_logprobs
                else None,
                response_weight_versions=[rng.randint(-1, 3) for _ in ids]
                if with_versions and rng.random() < 0.7
                else None,
            )
        )
    return outs


@pytest.mark.parametrize("seed", range(6))
def test_matches_the_row_by_row_reference(seed: int) -> None:
    rng = random.Random(seed)
    P, R = rng.choice([(0, 5), (4, 0), (6, 9), (17, 33)])
    log_probs = seed % 2 == 0
    outs = random_outputs(
        rng, rng.randint(1, 40), P, R, with_logprobs=0.8, with_versions=seed % 3 == 0
    )
    batch = postprocess(outs, prompt_length=P, response_length=R, pad_token_id=PAD,
                        calculate_log_probs=log_probs).batch
    want = reference(outs, P, R, log_probs)
    for key in (
        "prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids",
    ):
        assert batch[key].dtype == torch.int64, key
        assert batch[key].tolist() == want[key], key
    if log_probs:
        assert batch["rollout_log_probs"].dtype == torch.float32
        expected = np.asarray(want["rollout_log_probs"], dtype=np.float32).reshape(len(outs), R)
        # the same float32 rounding
        assert np.array_equal(batch["rollout_log_probs"].numpy(), expected)
    else:
        assert "rollout_log_probs" not in set(batch.keys())
    if any(o.response_weight_versions is not None for o in outs):
        assert batch["rollout_weight_versions"].tolist() == want["rollout_weight_versions"]
    # every column stands alone: no views into another column's storage
    for key, column in batch.items():
        assert column.is_contiguous(), key
    assert (
        batch["responses"].untyped_storage().data_ptr()
        != batch["input_ids"].untyped_storage().data_ptr()
    )


def test_numpy_rows_and_odd_item_types_are_accepted() -> None:
    """Rows that are numpy arrays, numpy scalars or bools pad like lists (no type-specific fast
    path leaks)."""
    out = AgentLoopOutput.model_construct(
        prompt_ids=np.array([3, 4, 5]), response_ids=[np.int64(8), 9], response_mask=[True, False],
        response_logprobs=[np.float32(-0.5), -1], reward_score=None, num_turns=1)
    batch = postprocess(
        [out], prompt_length=2, response_length=3, pad_token_id=0, calculate_log_probs=True
    ).batch
    assert batch["prompts"].tolist() == [[4, 5]]
    assert batch["responses"].tolist() == [[8, 9, 0]]
    assert batch["response_mask"].tolist() == [[1, 0, 0]]
    assert batch["rollout_log_probs"].tolist() == [[-0.5, -1.0, 0.0]]


class ListScanLeastInFlight:
    """The previous LeastInFlight: builds the tied list and picks from it."""

    def __init__(self, tie_break: str, seed: int) -> None:
        self.tie_break, self._rng, self._cursor = tie_break, random.Random(seed), 0

    def choose(self, ctx: RouteContext, in_flight: Sequence[int]) -> int:
        low = min(in_flight)
        tied = [i for i, c in enumerate(in_flight) if c == low]
        if len(tied) == 1:
            return tied[0]
        if self.tie_break == "random":
            return self._rng.choice(tied)
        self._cursor += 1
        return tied[self._cursor % len(tied)]


@pytest.mark.parametrize("tie_break", ["random", "rotate"])
@pytest.mark.parametrize("servers", [1, 2, 7, 64, 256])
def test_least_in_flight_chooses_as_the_list_scan(tie_break: str, servers: int) -> None:
    rng = random.Random(servers)
    new, old = LeastInFlight(tie_break, seed=3), ListScanLeastInFlight(tie_break, seed=3)
    for step in range(400):
        spread = rng.choice([0, 1, 2, 5])
        counts = [rng.randint(0, spread) for _ in range(servers)]
        if step % 7 == 0:
            counts = tuple(counts)  # any sequence, not only lists
        ctx = RouteContext(f"r{step}")
        assert new.choose(ctx, counts) == old.choose(ctx, counts), (step, counts)


@pytest.mark.parametrize("tie_break", ["random", "rotate"])
def test_balancer_with_faults_routes_as_before(tie_break: str) -> None:
    """Through the Balancer (sticky, releases, servers down and up) the two make the same
    decisions."""
    balancers = [Balancer(16, StickySession(cls(tie_break, seed=5), max_cache_size=50))
                 for cls in (LeastInFlight, ListScanLeastInFlight)]
    rng = random.Random(0)
    live: list[int] = []
    for step in range(3000):
        op = rng.random()
        if op < 0.02:
            server = rng.randrange(16)
            if sum(balancers[0].healthy) > 1:  # keep one server up
                for b in balancers:
                    b.mark_down(server)
        elif op < 0.05:
            server = rng.randrange(16)
            for b in balancers:
                b.mark_up(server)
        elif op < 0.45 and live:
            server = live.pop(rng.randrange(len(live)))
            for b in balancers:
                b.release(server)
        else:
            rid = f"r{rng.randrange(200)}"
            got = [b.acquire(rid) for b in balancers]
            assert got[0] == got[1], step
            live.append(got[0])
    assert balancers[0].stats() == balancers[1].stats()
