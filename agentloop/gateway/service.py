"""GatewayService: sessions and chat completions, independent of HTTP and Ray.

One service per gateway actor; a session owns a branch-aware trajectory store
(:class:`agentloop.gateway.store.SessionStore`).  A chat request is checked, placed in the store (only
its new suffix encoded), clamped to the branch's response budget, generated through the router (sticky
per conversation root) and committed as a new sibling; it raises
:class:`~agentloop.gateway.protocol.GatewayHTTPError` for what the client must see (400 / 401 / 404 / 409,
502 / 503 for engine faults, with nothing committed).  Spec (the five steps, the budget):
docs/gateway.md#a-chat-request-step-by-step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError
from pydantic import BaseModel
from ray.exceptions import RayActorError, RayError

from agentloop.errors import RoutingError
from agentloop.gateway.decode import StreamDecoder, decode_turn
from agentloop.gateway.protocol import (
    ChatRequest,
    GatewayHTTPError,
    chunk_body,
    completion_body,
    new_completion_id,
    parse_chat_request,
    usage,
)
from agentloop.gateway.store import SessionStore, StoreError
from agentloop.parsers.base import ToolParser
from agentloop.servers.base import ServerDeadError
from agentloop.tokenization import TemplateMismatchError
from agentloop.types import StopReason

logger = logging.getLogger(__name__)


class SessionHandle(BaseModel):
    """What an agent needs to talk to its session: the OpenAI ``base_url`` and ``api_key``."""

    session_id: str
    base_url: str
    api_key: str


@dataclass
class Session:
    """Server-side state of one session."""

    session_id: str
    api_key: str
    store: SessionStore
    metadata: dict[str, Any] = field(default_factory=dict)
    sampling_params: dict[str, Any] = field(default_factory=dict)
    state: str = "active"  # active | completed | aborted
    reward_info: dict[str, Any] | None = None
    in_flight: dict[str, str] = field(default_factory=dict)  # request id -> its sticky routing key
    num_requests: int = 0
    num_parse_errors: int = 0
    num_length_refusals: int = 0
    prompt_over_length: int = 0  # the longest refused prompt (tokens) of a branch over prompt_length
    created: float = field(default_factory=time.time)


@dataclass
class _Turn:
    """A reserved request on its way through the engine."""

    session: Session
    request: ChatRequest
    reservation: Any
    request_id: str
    params: dict[str, Any]
    sticky_key: str
    http_id: str


class GatewayService:
    """Sessions plus the chat-completions logic (docs/gateway.md#a-chat-request-step-by-step).

    Args:
        tokenizer: the served model's tokenizer.
        router: an :class:`agentloop.routing.AsyncLLMServerManager` (or anything with ``generate``,
            ``generate_stream`` and ``abort`` of the same signatures).
        parser: the tool parser for ``multi_turn.format`` (None: no tool-call parsing).
        max_length: per-trajectory token budget (default ``prompt_length + response_length``).
        prompt_length: a branch's prompt (first context run) budget; None: only ``max_length`` counts.
        response_length: a branch's response budget (docs/gateway.md, "The response budget"); None:
            only ``max_length`` counts.
        base_url: this gateway's URL; sessions live under ``{base_url}/sessions/{id}/v1``.
        calculate_log_probs: record the engine's logprobs in trajectories.
        model_name: the name ``GET /v1/models`` lists.
    """

    def __init__(
        self, tokenizer: Any, router: Any, parser: ToolParser | None, *, max_length: int | None = None,
        prompt_length: int | None = None, response_length: int | None = None,
        base_url: str = "", calculate_log_probs: bool = True, model_name: str = "agentloop",
    ) -> None:
        if max_length is None:
            if prompt_length is None or response_length is None:
                raise ValueError("GatewayService needs max_length, or both prompt_length and response_length")
            max_length = int(prompt_length) + int(response_length)
        self.tokenizer = tokenizer
        self.router = router
        self.parser = parser
        self.max_length = int(max_length)
        self.prompt_length = None if prompt_length is None else int(prompt_length)
        self.response_length = None if response_length is None else int(response_length)
        self.base_url = base_url
        self.calculate_log_probs = calculate_log_probs
        self.model_name = model_name
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
        session = Session(session_id=sid, api_key=f"sk-agentloop-{secrets.token_urlsafe(24)}",
                          store=SessionStore(self.tokenizer, max_length=self.max_length),
                          metadata=dict(metadata or {}), sampling_params=dict(sampling_params or {}))
        self.sessions[sid] = session
        return SessionHandle(session_id=sid, base_url=f"{self.base_url}/sessions/{sid}/v1", api_key=session.api_key)

    def session(self, session_id: str, api_key: str | None = None, *, check_key: bool = False) -> Session:
        """The session (404 if unknown; 401 when ``check_key`` and the key is missing or wrong)."""
        session = self.sessions.get(session_id)
        if session is None:
            raise GatewayHTTPError(404, f"session {session_id!r} not found", type_="not_found_error")
        if check_key and not (api_key and hmac.compare_digest(api_key, session.api_key)):
            raise GatewayHTTPError(401, "missing or wrong API key for this session (send it as 'Authorization: "
                                        "Bearer <api_key>' — the api_key of the session handle)",
                                   type_="authentication_error")
        return session

    def complete(self, session_id: str, reward_info: dict[str, Any] | None = None) -> dict[str, Any]:
        """Mark the session done (later chat requests get 409); keep ``reward_info`` for the trainer."""
        session = self._active(session_id)
        session.state = "completed"
        session.reward_info = reward_info
        return self.get_state(session_id)

    async def abort(self, session_id: str) -> dict[str, Any]:
        """Abort the session: in-flight generations are aborted and nothing more is committed."""
        session = self.session(session_id)
        session.state = "aborted"
        await asyncio.gather(*(self.router.abort(rid, sticky_key=key) for rid, key in list(session.in_flight.items())),
                             return_exceptions=True)
        return self.get_state(session_id)

    async def finalize(self, session_id: str, longest_only: bool = False) -> dict[str, Any]:
        """Close the session and return its trajectories (one per leaf branch) and reward info."""
        session = self.session(session_id)
        if session.in_flight:
            await self.abort(session_id)
        self.sessions.pop(session_id, None)
        trajectories = session.store.trajectories(longest_only=longest_only)
        return {"session_id": session_id, "state": session.state, "reward_info": session.reward_info,
                "metadata": session.metadata, "trajectories": trajectories, "stats": self._stats(session)}

    def get_state(self, session_id: str) -> dict[str, Any]:
        """Status and counters of a session."""
        session = self.session(session_id)
        return {"session_id": session_id, "state": session.state, "num_requests": session.num_requests,
                "in_flight": len(session.in_flight), "reward_info": session.reward_info,
                "stats": self._stats(session)}

    def _stats(self, session: Session) -> dict[str, Any]:
        return {**session.store.stats(), "num_parse_errors": session.num_parse_errors,
                "num_requests": session.num_requests, "num_length_refusals": session.num_length_refusals,
                "prompt_over_length": session.prompt_over_length}

    def _active(self, session_id: str) -> Session:
        session = self.session(session_id)
        if session.state != "active":
            raise GatewayHTTPError(409, f"session {session_id!r} is {session.state}; open a new session",
                                   type_="conflict")
        return session

    # ---- chat completions ------------------------------------------------------------------
    async def chat(self, session_id: str, body: Any, request_id: str | None = None
                   ) -> dict[str, Any] | AsyncIterator[str]:
        """Serve one chat request: a ``chat.completion`` dict, or an iterator of SSE lines when streaming.

        ``request_id`` (the HTTP request's id) names this request in log lines and 5xx errors."""
        request = parse_chat_request(body)
        turn = self._reserve(self._active(session_id), request, request_id or f"req_{uuid.uuid4().hex[:24]}")
        if turn.params["max_tokens"] <= 0:  # the branch's budget is spent: no engine call
            session = turn.session
            session.num_length_refusals += 1
            if self.prompt_length is not None and turn.reservation.prompt_len > self.prompt_length:
                session.prompt_over_length = max(session.prompt_over_length, turn.reservation.prompt_len)
            session.store.release_spent(turn.reservation)
            return await self._respond_empty(turn)
        if request.stream:
            return self._stream(turn)
        return await self._generate(turn)

    def _reserve(self, session: Session, request: ChatRequest, http_id: str) -> _Turn:
        try:
            reservation = session.store.prepare(request.messages, request.tools)
        except StoreError as e:
            raise GatewayHTTPError(400, str(e), param="messages") from None
        except (TemplateError, TemplateMismatchError, TypeError, ValueError) as e:
            logger.info("request %s: the chat template cannot render the messages: %r", http_id, e)
            raise GatewayHTTPError(400, f"the chat template cannot render these messages ({type(e).__name__}: "
                                        f"{str(e)[:200]}); check the roles, contents and tool calls",
                                   param="messages") from None
        session.num_requests += 1
        params = {**session.sampling_params, **request.sampling}
        params["logprobs"] = bool(self.calculate_log_probs or request.want_logprobs)
        remaining = self._budget(reservation)
        params["max_tokens"] = min(int(params.get("max_tokens") or remaining), remaining)
        engine_id = f"{session.session_id}-{uuid.uuid4().hex[:12]}"
        return _Turn(session, request, reservation, engine_id, params, _branch_key(session, reservation), http_id)

    def _budget(self, reservation: Any) -> int:
        """Tokens this request may generate (the response budget, docs/gateway.md); <= 0: none."""
        remaining = int(reservation.remaining)
        if self.prompt_length is not None and reservation.prompt_len > self.prompt_length:
            return 0
        if self.response_length is not None:
            remaining = min(remaining, self.response_length - reservation.response_used)
        return remaining

    async def _respond_empty(self, turn: _Turn) -> dict[str, Any] | AsyncIterator[str]:
        message = {"role": "assistant", "content": ""}
        prompt_tokens = len(turn.reservation.prompt_ids)
        if not turn.request.stream:
            return completion_body(completion_id=new_completion_id(), model=turn.request.model, message=message,
                                   finish_reason="length", prompt_tokens=prompt_tokens, completion_tokens=0)

        async def events() -> AsyncIterator[str]:
            cid, created = new_completion_id(), int(time.time())
            yield _sse(chunk_body(completion_id=cid, model=turn.request.model, created=created,
                                  delta={"role": "assistant", "content": ""}))
            yield _sse(chunk_body(completion_id=cid, model=turn.request.model, created=created, delta={},
                                  finish_reason="length"))
            if turn.request.include_usage:
                yield _sse(chunk_body(completion_id=cid, model=turn.request.model, created=created, delta=None,
                                      usage_=usage(prompt_tokens, 0)))
            yield "data: [DONE]\n\n"

        return events()

    async def _generate(self, turn: _Turn) -> dict[str, Any]:
        turn.session.in_flight[turn.request_id] = turn.sticky_key
        try:
            out = await self.router.generate(
                turn.request_id, prompt_ids=list(turn.reservation.prompt_ids), sampling_params=turn.params,
                sticky_key=turn.sticky_key,
            )
        except Exception as e:
            turn.session.store.release(turn.reservation)
            raise _engine_error(e, turn) from None
        finally:
            turn.session.in_flight.pop(turn.request_id, None)
        message, finish = await self._commit(turn, out.token_ids, out.log_probs, out.stop_reason)
        logprobs = self._openai_logprobs(out.token_ids, out.log_probs) if turn.request.want_logprobs else None
        return completion_body(
            completion_id=new_completion_id(), model=turn.request.model, message=message, finish_reason=finish,
            prompt_tokens=len(turn.reservation.prompt_ids), completion_tokens=len(out.token_ids), logprobs=logprobs,
        )

    async def _commit(
        self, turn: _Turn, ids: list[int], log_probs: list[float] | None, stop: StopReason | None,
        seen_content: Callable[[str], str] | None = None,
    ) -> tuple[dict[str, Any], str]:
        """Decode and store one generation; an aborted one (or one of an aborted session) is not kept."""
        if stop == StopReason.ABORTED or turn.session.state == "aborted":
            turn.session.store.release(turn.reservation)
            raise GatewayHTTPError(409, f"session {turn.session.session_id!r} was aborted during generation",
                                   type_="conflict")
        limit = int(turn.params["max_tokens"])
        if len(ids) > limit:  # an engine that ignored max_tokens: keep the budget, say so
            logger.warning("request %s: the engine returned %d tokens for max_tokens=%d; keeping the first %d",
                           turn.http_id, len(ids), limit, limit)
            ids, stop = list(ids[:limit]), StopReason.LENGTH
            log_probs = None if log_probs is None else list(log_probs)[:limit]
        decoded = await decode_turn(self.parser, self.tokenizer, ids, stop or StopReason.STOP,
                                    turn.request.tools, turn.request.parse_tools)
        if seen_content is not None:
            seen = seen_content(decoded.message["content"] or "")
            decoded.message["content"] = seen or (None if decoded.message.get("tool_calls") else "")
        turn.session.num_parse_errors += decoded.num_parse_errors
        lps = list(log_probs) if log_probs is not None and len(log_probs) == len(ids) else None
        turn.session.store.commit(turn.reservation, list(ids), lps, decoded.message, decoded.finish_reason)
        return decoded.message, decoded.finish_reason

    def _openai_logprobs(self, ids: list[int], log_probs: list[float] | None) -> dict[str, Any] | None:
        if log_probs is None:
            return None
        content = []
        for token_id, lp in zip(ids, log_probs, strict=False):
            text = self.tokenizer.decode([token_id])
            content.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
        return {"content": content}

    async def _stream(self, turn: _Turn) -> AsyncIterator[str]:
        """Server-sent events; see :mod:`agentloop.gateway.decode` for what is held back."""
        model, cid, created = turn.request.model, new_completion_id(), int(time.time())
        parsing = self.parser is not None and turn.request.parse_tools
        hold = self.parser.tool_call_start if parsing and self.parser is not None else None
        decoder = StreamDecoder(self.tokenizer, hold, hold_all=parsing and hold is None)
        ids: list[int] = []
        lps: list[float] | None = [] if turn.params["logprobs"] else None
        stop: StopReason | None = None
        committed = False
        turn.session.in_flight[turn.request_id] = turn.sticky_key
        try:
            yield _sse(chunk_body(completion_id=cid, model=model, created=created,
                                  delta={"role": "assistant", "content": ""}))
            try:
                async for delta in self.router.generate_stream(
                    turn.request_id, prompt_ids=list(turn.reservation.prompt_ids), sampling_params=turn.params,
                    sticky_key=turn.sticky_key,
                ):
                    ids.extend(delta.token_ids)
                    if lps is not None:
                        lps = lps + list(delta.log_probs) if delta.log_probs is not None else None
                    text = decoder.push(delta.token_ids)
                    if text:
                        yield _sse(chunk_body(completion_id=cid, model=model, created=created,
                                              delta={"content": text}))
                    if delta.finished:
                        stop = delta.stop_reason
            except Exception as e:
                yield _sse(_engine_error(e, turn).body())
                return
            tails: list[str] = []

            def seen(content: str) -> str:
                tail, total = decoder.finish(content)
                tails.append(tail)
                return total

            try:
                message, finish = await self._commit(turn, ids, lps, stop, seen_content=seen)
            except GatewayHTTPError as e:
                yield _sse(e.body())
                return
            committed = True
            for chunk in _final_chunks("".join(tails), message, finish, cid, model, created):
                yield _sse(chunk)
            if turn.request.include_usage:
                yield _sse(chunk_body(completion_id=cid, model=model, created=created, delta=None,
                                      usage_=usage(len(turn.reservation.prompt_ids), len(ids))))
            yield "data: [DONE]\n\n"
        finally:
            turn.session.in_flight.pop(turn.request_id, None)
            if not committed:
                with contextlib.suppress(Exception):
                    turn.session.store.release(turn.reservation)
                if stop is None:  # the client went away mid-stream: stop the engine too
                    asyncio.get_running_loop().create_task(
                        _quiet(self.router.abort(turn.request_id, sticky_key=turn.sticky_key)))


def _branch_key(session: Session, reservation: Any) -> str:
    """Routing key of a request: its session and the root of its branch, so every continuation of a
    conversation reaches the server holding its prefix cache while independent conversations spread."""
    node = reservation.node
    while node.parent is not None:  # context → sampled → context … up to the root's child
        node = node.parent.parent
    return f"{session.session_id}/{node.seq}"


def _final_chunks(
    tail: str, message: dict[str, Any], finish: str, cid: str, model: str, created: int
) -> list[dict[str, Any]]:
    chunks: list[dict[str, Any]] = []
    if tail:
        chunks.append(chunk_body(completion_id=cid, model=model, created=created, delta={"content": tail}))
    calls = message.get("tool_calls") or []
    if calls:
        deltas = [{"index": i, **call} for i, call in enumerate(calls)]
        chunks.append(chunk_body(completion_id=cid, model=model, created=created, delta={"tool_calls": deltas}))
    chunks.append(chunk_body(completion_id=cid, model=model, created=created, delta={}, finish_reason=finish))
    return chunks


def _engine_error(e: Exception, turn: _Turn) -> GatewayHTTPError:
    """The client's view of an engine failure: 503 when no engine is reachable (a dead server actor or
    engine, nothing to route to), else 502.  Ray errors (their text carries tracebacks, actor ids, pids,
    addresses) are never shown; the full error goes to the log line ``request <id>: ...``."""
    if isinstance(e, GatewayHTTPError):
        if e.request_id is None:
            e.request_id = turn.http_id
        return e
    rid = turn.http_id
    logger.error("request %s: engine call failed (session %s, engine request %s): %s", rid,
                 turn.session.session_id, turn.request_id, e, exc_info=e)
    after = f"nothing was recorded for this request; the server log has the details under request id {rid}"
    if isinstance(e, (RayActorError, ServerDeadError, RoutingError)):
        return GatewayHTTPError(503, f"no inference engine is available right now; retry later ({after})",
                                type_="server_error", code="engine_unavailable", request_id=rid)
    reason = "" if isinstance(e, RayError) else f": {type(e).__name__}: {_first_line(e)}"  # in-process engines
    return GatewayHTTPError(502, f"the inference engine failed{reason} ({after})", type_="server_error",
                            code="engine_error", request_id=rid)


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else ""


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _quiet(coro: Any) -> None:
    with contextlib.suppress(Exception):
        await coro
