"""Fuzz the gateway's OpenAPI schema with schemathesis: whatever the body, never a 5xx other than
502.

Requests are sent to a live gateway (loopback) with a valid session and key, so generated bodies
reach the request checks and the engine path rather than stopping at 401/404.  Engine failures are
502 by design; a 500 would be an unhandled bug.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from gateway_helpers import LiveGateway  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402


@pytest.fixture(scope="module")
def live(request):
    from transformers import AutoTokenizer

    from agentloop.testing.tiny_model import ensure_tiny_model

    gw = LiveGateway(AutoTokenizer.from_pretrained(str(ensure_tiny_model())))
    request.addfinalizer(gw.close)
    return gw


def operations(live) -> list:
    schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def test_no_server_errors_on_generated_requests(live):
    ops = operations(live)
    assert {op.path for op in ops} >= {
        "/sessions/{session_id}/v1/chat/completions",
        "/sessions/{session_id}/complete",
    }
    for op in ops:
        check_operation(live, op)


def check_operation(live, op) -> None:
    @given(case=op.as_strategy())
    @settings(
        max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None
    )
    def run(case) -> None:
        handle = live.session()
        if case.path_parameters and "session_id" in case.path_parameters:
            case.path_parameters["session_id"] = handle.session_id
        response = case.call(
            base_url=live.url, headers={"Authorization": f"Bearer {handle.api_key}"}, timeout=30
        )
        assert response.status_code < 500 or response.status_code == 502, (
            op.path, response.status_code, response.text[:500],
        )
        if response.status_code >= 400:
            assert response.json()["error"]["message"]

    run()
