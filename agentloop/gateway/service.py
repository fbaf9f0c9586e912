"""GatewayService: sessions and their turns, independent of HTTP and Ray.

One service per gateway actor; a session owns a branch-aware trajectory store
(:class:`agentloop.gateway.store.SessionStore`).  A request in any wire format (a
:class:`~agentloop.gateway.dialects.base.Dialect`) is parsed into a canonical
:class:`~agentloop.gateway.turn.TurnRequest`, served by :meth:`GatewayService.serve` (placed in the
store with only its new suffix encoded, clamped to the branch's response budget, generated through
the router and committed as a new sibling; :class:`~agentloop.gateway.serving.TurnServer`) and
rendered back by the dialect.  Client-visible failures are
:class:`~agentloop.gateway.protocol.GatewayHTTPError` (400 / 401 / 404 / 409, 502 / 503 for engine
faults, with nothing committed).  Spec: docs/gateway.md#dialects and
docs/gateway.md#a-chat-request-step-by-step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

from agentloop.gateway.dialects import DIALECTS
from agentloop.gateway.dialects.base import Dialect
from agentloop.gateway.images import ImageEncoder
from agentloop.gateway.protocol import GatewayHTTPError
from agentloop.gateway.serving import PLACEMENT_ERRORS, Session, TurnServer, placement_error
from agentloop.gateway.store import SessionStore
from agentloop.gateway.turn import TurnEvent, TurnRequest, TurnResult
from agentloop.parsers.base import ToolParser
from agentloop.parsers.reasoning import ReasoningParser

__all__ = ["GatewayService", "Session", "SessionHandle"]


class SessionHandle(BaseModel):
    """What an agent needs to talk to its session: the OpenAI ``base_url`` and ``api_key``."""

    session_id: str
    base_url: str
    api_key: str


class GatewayService(TurnServer):
    """Sessions plus their turns in every dialect (docs/gateway.md#dialects).

    Args:
        tokenizer: the served model's tokenizer.
        router: an :class:`agentloop.routing.AsyncLLMServerManager` (or anything with ``generate``,
            ``generate_stream`` and ``abort`` of the same signatures).
        parser: the tool parser for ``multi_turn.format`` (None: no tool-call parsing).
        max_length: per-trajectory token budget (default ``prompt_length + response_length``).
        prompt_length: a branch's prompt (first context run) budget; None: only ``max_length``
        counts. response_length: a branch's response budget (docs/gateway.md, "The response
        budget"); None:
            only ``max_length`` counts.
        base_url: this gateway's URL; sessions live under ``{base_url}/sessions/{id}/v1``.
        calculate_log_probs: record the engine's logprobs in trajectories.
        model_name: the name ``GET /v1/models`` lists.
        images: decodes and places image parts (:class:`~agentloop.gateway.images.ImageEncoder` with
        the
            model's processor and ``rollout.gateway.max_image_bytes``); None: a text-only model
            (images 400).
        reasoning: the reasoning parser for ``rollout.gateway.reasoning_parser`` (None: no reasoning
        split).
    """

    def __init__(
        self, tokenizer: Any, router: Any, parser: ToolParser | None, *,
        max_length: int | None = None, prompt_length: int | None = None,
        response_length: int | None = None, base_url: str = "", calculate_log_probs: bool = True,
        model_name: str = "agentloop", images: ImageEncoder | None = None,
        reasoning: ReasoningParser | None = None,
    ) -> None:
        if max_length is None:
            if prompt_length is None or response_length is None:
                raise ValueError(
                    "GatewayService needs max_length, or both prompt_length and response_length"
                )
            max_length = int(prompt_length) + int(response_length)
        self.tokenizer = tokenizer
        self.router = router
        self.parser = parser
        self.reasoning = reasoning
        self.max_length = int(max_length)
        self.prompt_length = None if prompt_length is None else int(prompt_length)
        self.response_length = None if response_length is None else int(response_length)
        self.base_url = base_url
        self.calculate_log_probs = calculate_log_probs
        self.model_name = model_name
        self.images = images if images is not None else ImageEncoder(model_name=model_name)
        self.sessions: dict[str, Session] = {}

    # ---- sessions -------------------------------------------------------------------------
    def create_session(
        self, session_id: str | None = None, metadata: dict[str, Any] | None = None,
        sampling_params: dict[str, Any] | None = None,
    ) -> SessionHandle:
        """Open a session; its key must be sent as the bearer token on every request."""
        sid = session_id or uuid.uuid4().hex
        if sid in self.sessions:
            raise GatewayHTTPError(409, f"session {sid!r} already exists", type_="conflict")
        session = Session(
            session_id=sid, api_key=f"sk-agentloop-{secrets.token_urlsafe(24)}",
            store=SessionStore(self.tokenizer, max_length=self.max_length, images=self.images),
            metadata=dict(metadata or {}), sampling_params=dict(sampling_params or {}),
        )
        self.sessions[sid] = session
        return SessionHandle(
            session_id=sid, base_url=f"{self.base_url}/sessions/{sid}/v1", api_key=session.api_key
        )

    def session(
        self, session_id: str, api_key: str | None = None, *, check_key: bool = False
    ) -> Session:
        """The session (404 if unknown; 401 when ``check_key`` and the key is missing or wrong)."""
        session = self.sessions.get(session_id)
        if session is None:
            raise GatewayHTTPError(
                404, f"session {session_id!r} not found", type_="not_found_error"
            )
        if check_key and not (api_key and hmac.compare_digest(api_key, session.api_key)):
            raise GatewayHTTPError(
                401,
                "missing or wrong API key for this session (send it "
                "as 'Authorization: "
                "Bearer <api_key>' — the api_key of the session handle)",
                type_="authentication_error",
            )
        return session

    def complete(
        self, session_id: str, reward_info: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Mark the session done (later chat requests get 409); keep ``reward_info`` for the
        trainer."""
        session = self._active(session_id)
        session.state = "completed"
        session.reward_info = reward_info
        return self.get_state(session_id)

    async def abort(self, session_id: str) -> dict[str, Any]:
        """Abort the session: in-flight generations are aborted and nothing more is committed."""
        session = self.session(session_id)
        session.state = "aborted"
        await asyncio.gather(
            *(
                self.router.abort(rid, sticky_key=key)
                for rid, key in list(session.in_flight.items())
            ),
            return_exceptions=True,
        )
        return self.get_state(session_id)

    async def finalize(self, session_id: str, longest_only: bool = False) -> dict[str, Any]:
        """Close the session and return its trajectories (one per leaf branch) and reward info."""
        session = self.session(session_id)
        if session.in_flight:
            await self.abort(session_id)
        self.sessions.pop(session_id, None)
        trajectories = session.store.trajectories(longest_only=longest_only)
        return {
            "session_id": session_id, "state": session.state, "reward_info": session.reward_info,
            "metadata": session.metadata, "trajectories": trajectories,
            "stats": self._stats(session),
        }

    def get_state(self, session_id: str) -> dict[str, Any]:
        """Status and counters of a session."""
        session = self.session(session_id)
        return {
            "session_id": session_id, "state": session.state, "num_requests": session.num_requests,
            "in_flight": len(session.in_flight), "reward_info": session.reward_info,
            "stats": self._stats(session),
        }

    def _stats(self, session: Session) -> dict[str, Any]:
        return {
            **session.store.stats(), "num_parse_errors": session.num_parse_errors,
            "num_requests": session.num_requests,
            "num_length_refusals": session.num_length_refusals,
            "prompt_over_length": session.prompt_over_length,
        }

    def _active(self, session_id: str) -> Session:
        session = self.session(session_id)
        if session.state != "active":
            raise GatewayHTTPError(
                409, f"session {session_id!r} is {session.state}; open a new session",
                type_="conflict",
            )
        return session

    def dialect_state(self, session_id: str, name: str) -> dict[str, Any]:
        """The per-session state dict of dialect ``name`` (e.g. stored responses), created empty
        (404 if the session is unknown)."""
        return self.session(session_id).dialect_states.setdefault(name, {})

    # ---- turns -------------------------------------------------------------------------------
    async def serve(self, session_id: str, request: TurnRequest, request_id: str | None = None
                    ) -> TurnResult | AsyncIterator[TurnEvent]:
        """Serve one canonical request: its :class:`TurnResult`, or when ``request.stream`` an
        iterator of deltas ending with the result (a failure after the stream began is raised from
        the iterator).

        ``request_id`` (the HTTP request's id) names this request in log lines and 5xx errors.

        Raises:
            GatewayHTTPError: 404 / 409 for an unknown or finished session, 400 for messages the
            store or
                template refuses, 502 / 503 for engine faults; nothing is committed then.
        """
        session = self._active(session_id)
        return await self.serve_turn(session, request, request_id or f"req_{uuid.uuid4().hex[:24]}")

    async def handle(
        self, session_id: str, dialect: Dialect, body: Any, request_id: str | None = None
    ) -> dict[str, Any] | AsyncIterator[str]:
        """One request in ``dialect``'s wire format: parse, :meth:`serve`, render.

        Returns:
            The reply body, or when streaming an iterator of server-sent-event lines (closing it
            early aborts the engine request).

        Raises:
            GatewayHTTPError: the dialect's refusals (400) and :meth:`serve`'s errors.
        """
        session = self.sessions.get(session_id)
        state = {} if session is None else session.dialect_states.setdefault(dialect.name, {})
        request = dialect.parse(body, state)
        served = await self.serve(session_id, request, request_id)
        if isinstance(served, TurnResult):
            return dialect.render(served, request, state)
        return _closing(dialect.render_stream(served, request, state), served)

    async def chat(self, session_id: str, body: Any, request_id: str | None = None
                   ) -> dict[str, Any] | AsyncIterator[str]:
        """Serve one chat-completions request: a ``chat.completion`` dict, or an iterator of SSE
        lines when streaming (:meth:`handle` with the chat dialect)."""
        return await self.handle(session_id, DIALECTS["chat"], body, request_id)

    def count_tokens(self, session_id: str, request: TurnRequest) -> int:
        """Prompt tokens ``request`` would have in this session (as :meth:`serve` would place it);
        nothing is reserved or recorded.

        Raises:
            GatewayHTTPError: 404 for an unknown session, 400 for messages the store or template
            refuses.
        """
        session = self.session(session_id)
        try:
            return session.store.count_prompt_tokens(request.messages, request.tools)
        except PLACEMENT_ERRORS as e:
            raise placement_error(e, "count_tokens") from None


async def _closing(
    lines: AsyncIterator[str], events: AsyncIterator[TurnEvent]
) -> AsyncIterator[str]:
    """``lines`` (a dialect's rendering of ``events``), closing ``events`` when the client stops
    reading, so the engine request is aborted whatever the dialect's renderer does."""
    try:
        async for line in lines:
            yield line
    finally:
        with contextlib.suppress(Exception):
            await events.aclose()  # type: ignore[attr-defined]
