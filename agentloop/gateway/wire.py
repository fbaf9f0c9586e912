"""Request pieces shared by the gateway's FastAPI routes and its fast path
(:mod:`agentloop.gateway.fastpath`): request ids, the session key from headers, the body limit and
JSON decoding.  Spec: docs/gateway.md#http-api."""

from __future__ import annotations

import json
import uuid
from typing import Any

from agentloop.gateway.protocol import GatewayHTTPError

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays / objects a request body may have."""


def check_declared_length(declared: str | None, max_body_bytes: int) -> None:
    """Raise the 413 for a ``content-length`` header over ``max_body_bytes``."""
    if declared and declared.isdigit() and int(declared) > max_body_bytes:
        raise GatewayHTTPError(
            413, f"request body of {declared} bytes is over the limit of {max_body_bytes}",
            type_="request_too_large",
        )


def too_large(max_body_bytes: int) -> GatewayHTTPError:
    """The 413 of a body that passed ``max_body_bytes`` while being read."""
    return GatewayHTTPError(413, f"request body is over the limit of {max_body_bytes} bytes",
                            type_="request_too_large")


def parse_body(raw: bytes, *, required: bool = True) -> Any:
    """The decoded JSON of a whole body; 400 when empty (None if not ``required``) or not JSON."""
    if not raw.strip():
        if required:
            raise GatewayHTTPError(400, "the request body is empty; send a JSON object")
        return None
    return decode_json(raw)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (use a finite number or null)")


def decode_json(raw: bytes) -> Any:
    """Parse a request body; 400 for invalid JSON, non-finite numbers, huge integers or too deep
    nesting."""
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        value = None
        deep = True
    # JSONDecodeError, NaN, integers over Python's digit limit
    except (ValueError, UnicodeDecodeError) as e:
        raise GatewayHTTPError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None
    else:
        deep = json_depth_over(value, MAX_JSON_DEPTH)
    if deep:
        raise GatewayHTTPError(
            400,
            f"the request body nests arrays/objects more than "
            f"{MAX_JSON_DEPTH} levels deep; "
            "flatten it",
        )
    return value


def json_depth_over(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists / dicts more than ``limit`` levels deep (iterative, no
    recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def key_from_headers(authorization: str, x_api_key: str) -> str | None:
    """The session key of these header values: the Bearer token, else ``x-api-key``; None if
    neither."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return x_api_key.strip() or None


def new_request_id() -> str:
    """``req_…`` id."""
    return f"req_{uuid.uuid4().hex[:24]}"


def internal_error(rid: str) -> GatewayHTTPError:
    """The 500 of an unhandled error in request ``rid`` (details only in the log)."""
    return GatewayHTTPError(
        500, f"internal gateway error; the server log has the details under request id {rid}",
        type_="server_error", request_id=rid,
    )
