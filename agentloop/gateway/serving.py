"""Serving one canonical turn against a session's trie: reserve, budget, generate or stream, commit.

:class:`TurnServer` is the dialect-neutral half of
:class:`~agentloop.gateway.service.GatewayService`: a :class:`~agentloop.gateway.turn.TurnRequest`
is placed in the session's store (only its new suffix encoded), clamped to the branch's response
budget, generated through the router (sticky per conversation root) and committed as a new sibling.
It returns a :class:`~agentloop.gateway.turn.TurnResult`, or when streaming an iterator of
:data:`~agentloop.gateway.turn.TurnEvent`; client-visible failures are
:class:`~agentloop.gateway.protocol.GatewayHTTPError` (nothing committed).  Spec:
docs/gateway.md#a-chat-request-step-by-step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError
from ray.exceptions import RayActorError, RayError

from agentloop.batch.routed_experts import PROMPT_START_KEY, call_rows, prompt_start
from agentloop.errors import RoutingError
from agentloop.gateway import constraints
from agentloop.gateway.decode import StreamDecoder, decode_turn
from agentloop.gateway.images import ImagePartError
from agentloop.gateway.protocol import GatewayHTTPError
from agentloop.gateway.store import SessionStore, StoreError
from agentloop.gateway.turn import TurnEvent, TurnRequest, TurnResult
from agentloop.parsers.base import ToolParser
from agentloop.parsers.reasoning import ReasoningParser
from agentloop.servers.base import ServerDeadError
from agentloop.tokenization import TemplateMismatchError
from agentloop.types import StopReason

logger = logging.getLogger(__name__)


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
    # the longest refused prompt (tokens) of a branch over prompt_length
    prompt_over_length: int = 0
    created: float = field(default_factory=time.time)
    # dialect name -> its state
    dialect_states: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class Turn:
    """A reserved request on its way through the engine."""

    session: Session
    request: TurnRequest
    reservation: Any
    request_id: str
    params: dict[str, Any]
    sticky_key: str
    http_id: str
    constrained: bool = False  # sampled under a grammar (gateway/constraints.py)


class TurnServer:
    """Serves canonical turns (docs/gateway.md#a-chat-request-step-by-step).

    A base class: the subclass sets ``tokenizer``, ``router``, ``parser``, ``prompt_length``,
    ``response_length`` and ``calculate_log_probs`` (read on every request, so they may be
    replaced).
    """

    tokenizer: Any
    router: Any
    parser: ToolParser | None
    # splits <think> into reasoning_content (docs/gateway.md#reasoning)
    reasoning: ReasoningParser | None = None
    prompt_length: int | None
    response_length: int | None
    calculate_log_probs: bool

    async def serve_turn(self, session: Session, request: TurnRequest, http_id: str
                         ) -> TurnResult | AsyncIterator[TurnEvent]:
        """Serve ``request`` on an active ``session``: the result, or its events when
        ``request.stream``.

        Raises:
            GatewayHTTPError: 400 when the messages cannot be placed or rendered, 409 when the
            session is
                aborted meanwhile, 502 / 503 for engine faults (non-streaming; a stream raises them
                from its iterator).  Nothing is committed then.
        """
        turn = self._reserve(session, request, http_id)
        if turn.params["max_tokens"] <= 0:  # the branch's budget is spent: no engine call
            result = self._spent(turn)
            return _single(result) if request.stream else result
        if request.stream:
            return self._stream(turn)
        return await self._generate(turn)

    def reserve_prompt(self, session: Session, request: TurnRequest, http_id: str) -> Any:
        """Place ``request``'s messages in the session's store; returns the store's reservation.

        Raises:
            GatewayHTTPError: 400 when the store refuses the messages or the template cannot render
            them.
        """
        try:
            return session.store.prepare(request.messages, request.tools)
        except PLACEMENT_ERRORS as e:
            raise placement_error(e, http_id) from None

    def _reserve(self, session: Session, request: TurnRequest, http_id: str) -> Turn:
        grammar: dict[str, Any] = {}
        # 400s before any placing
        constrained = constraints.apply(request, self.parser, grammar, self.reasoning)
        reservation = self.reserve_prompt(session, request, http_id)
        session.num_requests += 1
        params = {**session.sampling_params, **request.sampling, **grammar,
                  **prompt_start(session.store.known_routing(reservation))}  # routing replay
        params["logprobs"] = bool(self.calculate_log_probs or request.want_logprobs)
        remaining = self._budget(reservation)
        params["max_tokens"] = min(int(params.get("max_tokens") or remaining), remaining)
        engine_id = f"{session.session_id}-{uuid.uuid4().hex[:12]}"
        return Turn(
            session, request, reservation, engine_id, params, _branch_key(session, reservation),
            http_id, constrained,
        )

    def _budget(self, reservation: Any) -> int:
        """Tokens this request may generate (the response budget, docs/gateway.md); <= 0: none."""
        remaining = int(reservation.remaining)
        if self.prompt_length is not None and reservation.prompt_len > self.prompt_length:
            return 0
        if self.response_length is not None:
            remaining = min(remaining, self.response_length - reservation.response_used)
        return remaining

    def _spent(self, turn: Turn) -> TurnResult:
        """The empty ``length`` turn of a branch without budget (counted, its new context
        dropped)."""
        session = turn.session
        session.num_length_refusals += 1
        if self.prompt_length is not None and turn.reservation.prompt_len > self.prompt_length:
            session.prompt_over_length = max(
                session.prompt_over_length, turn.reservation.prompt_len
            )
        session.store.release_spent(turn.reservation)
        return TurnResult(message={"role": "assistant", "content": ""}, finish_reason="length",
                          prompt_tokens=len(turn.reservation.prompt_ids), completion_tokens=0)

    async def _generate(self, turn: Turn) -> TurnResult:
        turn.session.in_flight[turn.request_id] = turn.sticky_key
        try:
            out = await self.router.generate(
                turn.request_id, prompt_ids=list(turn.reservation.prompt_ids),
                sampling_params=turn.params, sticky_key=turn.sticky_key,
                image_data=turn.reservation.images or None,
            )
        except Exception as e:
            turn.session.store.release(turn.reservation)
            raise _engine_error(e, turn) from None
        finally:
            turn.session.in_flight.pop(turn.request_id, None)
        result = await self._commit(
            turn, out.token_ids, out.log_probs, out.stop_reason, out.stop_sequence, routed=out
        )
        if turn.request.want_logprobs:
            result.logprobs = self._openai_logprobs(out.token_ids, out.log_probs)
        return result

    async def _commit(
        self, turn: Turn, ids: list[int], log_probs: list[float] | None, stop: StopReason | None,
        stop_sequence: str | None, settle: Callable[[dict[str, Any]], None] | None = None,
        routed: Any = None,
    ) -> TurnResult:
        """Decode and store one generation; an aborted one (or one of an aborted session) is not
        kept.  ``routed``: the output (or last stream chunk) carrying its routed experts."""
        if stop == StopReason.ABORTED or turn.session.state == "aborted":
            turn.session.store.release(turn.reservation)
            raise GatewayHTTPError(
                409, f"session {turn.session.session_id!r} was aborted during generation",
                type_="conflict",
            )
        limit = int(turn.params["max_tokens"])
        if len(ids) > limit:  # an engine that ignored max_tokens: keep the budget, say so
            logger.warning(
                "request %s: the engine returned %d tokens for max_tokens=%d; keeping the first %d",
                turn.http_id, len(ids), limit, limit,
            )
            ids, stop, stop_sequence = list(ids[:limit]), StopReason.LENGTH, None
            log_probs = None if log_probs is None else list(log_probs)[:limit]
        decoded = await decode_turn(
            self.parser, self.tokenizer, ids, stop or StopReason.STOP, turn.request.tools,
            turn.request.parse_tools, reasoning=self.reasoning,
        )
        if settle is not None:  # streaming: the stored turn is what the client was sent
            settle(decoded.message)
        turn.session.num_parse_errors += decoded.num_parse_errors
        lps = list(log_probs) if log_probs is not None and len(log_probs) == len(ids) else None
        prompt_ids = turn.reservation.prompt_ids
        turn.session.store.commit(
            turn.reservation, list(ids), lps, decoded.message, decoded.finish_reason,
            constrained=turn.constrained, routed=call_rows(
                routed, int(turn.params.get(PROMPT_START_KEY, 0)), len(prompt_ids) + len(ids)),
        )
        return TurnResult(
            message=decoded.message, finish_reason=decoded.finish_reason,
            prompt_tokens=len(turn.reservation.prompt_ids), completion_tokens=len(ids),
            stop_sequence=stop_sequence if decoded.finish_reason == "stop" else None,
            constrained=turn.constrained,
        )

    def _openai_logprobs(
        self, ids: list[int], log_probs: list[float] | None
    ) -> dict[str, Any] | None:
        if log_probs is None:
            return None
        content = []
        for token_id, lp in zip(ids, log_probs, strict=False):
            text = self.tokenizer.decode([token_id])
            content.append(
                {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
            )
        return {"content": content}

    def _stream_decoder(self, turn: Turn) -> StreamDecoder:
        parsing = self.parser is not None and turn.request.parse_tools
        hold = self.parser.tool_call_start if parsing and self.parser is not None else None
        return StreamDecoder(
            self.tokenizer, hold, hold_all=parsing and hold is None, reasoning=self.reasoning
        )

    async def _stream(self, turn: Turn) -> AsyncIterator[TurnEvent]:
        """Deltas as the engine samples them, then the committed result; see
        :mod:`agentloop.gateway.decode` for what is held back.  Closing the iterator early aborts
        the engine request."""
        decoder = self._stream_decoder(turn)
        ids: list[int] = []
        lps: list[float] | None = [] if turn.params["logprobs"] else None
        stop: StopReason | None = None
        stop_sequence: str | None = None
        last: Any = None  # the last chunk: routing replay's rows
        committed = False
        turn.session.in_flight[turn.request_id] = turn.sticky_key
        try:
            try:
                async for delta in self.router.generate_stream(
                    turn.request_id, prompt_ids=list(turn.reservation.prompt_ids),
                    sampling_params=turn.params, sticky_key=turn.sticky_key,
                    image_data=turn.reservation.images or None,
                ):
                    ids.extend(delta.token_ids)
                    if lps is not None:
                        lps = lps + list(delta.log_probs) if delta.log_probs is not None else None
                    for event in decoder.push_deltas(delta.token_ids):  # reasoning, then content
                        yield event
                    if delta.finished:
                        stop, stop_sequence = delta.stop_reason, delta.stop_sequence
                        last = delta
            except Exception as e:
                raise _engine_error(e, turn) from None
            tails: list[TurnEvent] = []
            result = await self._commit(
                turn, ids, lps, stop, stop_sequence,
                settle=lambda message: tails.extend(decoder.settle(message)), routed=last,
            )
            committed = True
            for tail in tails:
                yield tail
            yield result
        finally:
            turn.session.in_flight.pop(turn.request_id, None)
            if not committed:
                with contextlib.suppress(Exception):
                    turn.session.store.release(turn.reservation)
                # the client went away mid-stream (or the engine failed): stop the engine
                if stop is None:
                    asyncio.get_running_loop().create_task(
                        _quiet(self.router.abort(turn.request_id, sticky_key=turn.sticky_key)))


PLACEMENT_ERRORS = (StoreError, TemplateError, TemplateMismatchError, TypeError, ValueError)
"""What placing messages in a store raises for a request the client must fix."""


def placement_error(e: Exception, http_id: str) -> GatewayHTTPError:
    """The 400 for one of :data:`PLACEMENT_ERRORS` (the template's text logged, trimmed for the
    client)."""
    if isinstance(e, StoreError):
        return GatewayHTTPError(400, str(e), param="messages")
    # a bad image, or images for a text-only model: the part is named
    if isinstance(e, ImagePartError):
        return GatewayHTTPError(400, str(e), param=e.param)
    logger.info("request %s: the chat template cannot render the messages: %r", http_id, e)
    return GatewayHTTPError(
        400,
        f"the chat template cannot render these messages "
        f"({type(e).__name__}: "
        f"{str(e)[:200]}); check the roles, contents and tool "
        f"calls",
        param="messages",
    )


async def _single(result: TurnResult) -> AsyncIterator[TurnEvent]:
    yield result


def _branch_key(session: Session, reservation: Any) -> str:
    """Routing key of a request: its session and the root of its branch, so every continuation of a
    conversation reaches the server holding its prefix cache while independent conversations spread.
    """
    node = reservation.node
    while node.parent is not None:  # context → sampled → context … up to the root's child
        node = node.parent.parent
    return f"{session.session_id}/{node.seq}"


def _engine_error(e: Exception, turn: Turn) -> GatewayHTTPError:
    """The client's view of an engine failure: 503 when no engine is reachable (a dead server actor
    or engine, nothing to route to), else 502.  Ray errors (their text carries tracebacks, actor
    ids, pids, addresses) are never shown; the full error goes to the log line
    ``request <id>: ...``."""
    if isinstance(e, GatewayHTTPError):
        if e.request_id is None:
            e.request_id = turn.http_id
        return e
    rid = turn.http_id
    logger.error("request %s: engine call failed (session %s, engine request %s): %s", rid,
                 turn.session.session_id, turn.request_id, e, exc_info=e)
    after = (
        f"nothing was recorded for this request; the server log has the details under "
        f"request id {rid}"
    )
    if isinstance(e, (RayActorError, ServerDeadError, RoutingError)):
        return GatewayHTTPError(
            503, f"no inference engine is available right now; retry later ({after})",
            type_="server_error", code="engine_unavailable", request_id=rid,
        )
    # in-process engines
    reason = "" if isinstance(e, RayError) else f": {type(e).__name__}: {_first_line(e)}"
    return GatewayHTTPError(
        502, f"the inference engine failed{reason} ({after})", type_="server_error",
        code="engine_error", request_id=rid,
    )


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else ""


async def _quiet(coro: Any) -> None:
    with contextlib.suppress(Exception):
        await coro
