"""A request whose prompt leaves no room in the server's budget ends as ``length`` with no tokens
instead of vLLM refusing ``max_tokens=0`` (a self-play seat whose context filled up hit this)."""

from __future__ import annotations

import pytest

from agentloop.servers.vllm_io import NoBudget, sampling_params

pytest.importorskip("vllm")


def test_a_full_context_gives_no_budget_not_a_vllm_error() -> None:
    params = sampling_params({"temperature": 1.0}, prompt_len=300, prompt_length=100,
                             response_length=200)
    assert isinstance(params, NoBudget) and params.max_tokens == 0
    over = sampling_params({"max_tokens": 50}, prompt_len=400, prompt_length=100,
                           response_length=200)
    assert isinstance(over, NoBudget) and over.max_tokens < 0


def test_the_budget_caps_max_tokens() -> None:
    params = sampling_params({"max_tokens": 50}, prompt_len=280, prompt_length=100,
                             response_length=200)
    assert params.max_tokens == 20 and not isinstance(params, NoBudget)
    assert sampling_params({}, prompt_len=10, prompt_length=100,
                           response_length=200).max_tokens == 200
