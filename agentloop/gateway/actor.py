"""GatewayActor (one HTTP server in a Ray actor) and GatewayManager (spreads sessions over them).

A :class:`GatewayActor` runs uvicorn inside the actor's event loop, bound to ``host`` (default
127.0.0.1) on a port the OS picks, and reaches the engines through the same router as agent loops
(an :class:`~agentloop.routing.AsyncLLMServerManager` over the shared server handles and balancer).
:class:`GatewayManager` is a plain object: it opens each session on the gateway with the fewest
active sessions, reserving the slot before any await so concurrent opens spread out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any

import ray
import ray.exceptions
import uvicorn
from ray.actor import ActorHandle

from agentloop.config import GatewaySections
from agentloop.errors import ConfigError, ServerError, first_line
from agentloop.gateway.app import build_app
from agentloop.gateway.fastpath import GatewayApp
from agentloop.gateway.images import ImageEncoder
from agentloop.gateway.service import GatewayService, SessionHandle
from agentloop.parsers.base import get_tool_parser
from agentloop.parsers.reasoning import get_reasoning_parser
from agentloop.routing.factory import build_router
from agentloop.tokenization.loader import load_processor, load_tokenizer
from agentloop.utils.hangwatch import HangWatch
from agentloop.utils.process import restore_normal_priority

logger = logging.getLogger(__name__)


class GatewayActor:
    """One OpenAI-compatible gateway.  Call :meth:`start` (async) before opening sessions.

    Args:
        sections: the typed sections it reads (``GatewaySections.of(cfg)``:
        ``gateway.{host, max_body_bytes}``,
            the engine's lengths, ``multi_turn.format``, ``calculate_log_probs``, the model, and
            ``router``, the same router section the workers route with).
        server_handles: the engines (Ray actor handles or in-process servers).
        balancer: the GlobalBalancer actor, a local Balancer, or None.
        tokenizer: pass one to skip loading it from the model section.
        processor: the model's HF processor for image requests (docs/gateway.md#images); loaded from
        the
            model section only when neither it nor ``tokenizer`` is given (a text-only model: None).
        owner: the router's owner id (its balancer slots are released under it).
    """

    def __init__(self, sections: GatewaySections, server_handles: list[Any], balancer: Any = None,
                 tokenizer: Any = None, *, owner: str | None = None, processor: Any = None) -> None:
        restore_normal_priority(sections.engine.normal_priority)  # Ray starts actors at nice 15
        self.host = sections.gateway.host
        self.max_body_bytes = sections.gateway.max_body_bytes
        tok = tokenizer if tokenizer is not None else load_tokenizer(sections.model_config)
        if processor is None and tokenizer is None:
            processor = load_processor(sections.model_config, tok)
        router = build_router(sections.router, server_handles, balancer, owner=owner)
        self.service = GatewayService(
            tok,
            router,
            get_tool_parser(sections.multi_turn.format, tok),
            prompt_length=sections.engine.prompt_length,
            response_length=sections.engine.response_length,
            calculate_log_probs=sections.sampling.calculate_log_probs,
            model_name=sections.model_config.path,
            images=ImageEncoder(
                processor, sections.gateway.max_image_bytes, sections.model_config.path
            ),
            reasoning=get_reasoning_parser(sections.gateway.reasoning_parser, tok),
        )
        self._server: Any = None
        self._task: asyncio.Task | None = None
        self.app: GatewayApp | None = None
        """The HTTP application, once :meth:`start` built it."""
        self.url = ""

    @classmethod
    def from_slices(cls, rollout: Any, model: Any, server_handles: list[Any], *args: Any,
                    **kwargs: Any) -> GatewayActor:
        """A gateway from the ``rollout`` / ``model`` config slices
        (:meth:`GatewaySections.from_slices`: absent keys take the YAML's values,
        ``async_training.partial_rollout`` reads as false); ``args`` / ``kwargs``: the constructor's
        arguments after ``server_handles``."""
        return cls(GatewaySections.from_slices(rollout, model), server_handles, *args, **kwargs)

    async def start(self) -> str:
        """Start the HTTP server; returns its base URL (``http://host:port``)."""
        if self._server is not None:
            return self.url
        sock = socket.socket(
            socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM
        )
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit TCP_NODELAY: without it a response written in two parts waits
        # for the client's delayed ACK (~40 ms per request on Linux).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((self.host, 0))
        except OSError as e:
            raise ConfigError(
                f"gateway cannot bind to host {self.host!r} (rollout.gateway.host): {e}"
            ) from e
        port = sock.getsockname()[1]
        self.app = build_app(self.service, max_body_bytes=self.max_body_bytes)
        # proxy_headers off: no X-Forwarded-* rewriting layer per request (the gateway never reads
        # the client's address); docs/gateway.md#load
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                proxy_headers=False)
        self._server = uvicorn.Server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # re-raise the start-up error
            await asyncio.sleep(0.01)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{port}"
        self.service.base_url = self.url
        return self.url

    def replace_server(self, index: int, handle: Any) -> None:
        """Route to ``handle`` as server ``index`` from now on (the manager restarted a dead
        server)."""
        self.service.router.replace_server(index, handle)

    async def create_session(
        self, session_id: str | None = None, metadata: dict[str, Any] | None = None,
        sampling_params: dict[str, Any] | None = None,
    ) -> SessionHandle:
        """Open a session (see :meth:`GatewayService.create_session`)."""
        return self.service.create_session(session_id, metadata, sampling_params)

    async def complete(
        self, session_id: str, reward_info: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Mark a session complete."""
        return self.service.complete(session_id, reward_info)

    async def finalize(self, session_id: str, longest_only: bool = False) -> dict[str, Any]:
        """Close a session; returns its trajectories."""
        return await self.service.finalize(session_id, longest_only)

    async def create_sessions(self, calls: list[tuple[Any, ...]]) -> list[SessionHandle | None]:
        """:meth:`create_session` for each argument tuple, in one call (what
        :class:`GatewayManager` sends for opens made together); None where it raised, and nothing
        was opened for it (the caller repeats that one alone and gets its error)."""
        handles: list[SessionHandle | None] = []
        for args in calls:
            try:
                handles.append(self.service.create_session(*args))
            except Exception:  # noqa: BLE001 - repeated alone by the caller, which raises it
                handles.append(None)
        return handles

    async def finalize_sessions(self, calls: list[tuple[str, bool]]) -> list[dict[str, Any] | None]:
        """:meth:`finalize` for each ``(session_id, longest_only)``, in one call; None for a session
        that is unknown, has requests in flight, or whose finalize raised (it is left open, so the
        caller's repeat alone does exactly what :meth:`finalize` does)."""
        results: list[dict[str, Any] | None] = []
        sessions = self.service.sessions
        for session_id, longest_only in calls:
            session = sessions.get(session_id)
            if session is None or session.in_flight:
                results.append(None)
                continue
            try:
                results.append(await self.service.finalize(session_id, longest_only))
            except Exception:  # noqa: BLE001 - left open; the caller's repeat raises it
                sessions[session_id] = session
                results.append(None)
        return results

    async def abort(self, session_id: str) -> dict[str, Any]:
        """Abort a session's in-flight requests."""
        return await self.service.abort(session_id)

    async def get_state(self, session_id: str) -> dict[str, Any]:
        """A session's state and counters."""
        return self.service.get_state(session_id)

    async def num_sessions(self) -> int:
        """Open sessions."""
        return len(self.service.sessions)

    async def shutdown(self) -> None:
        """Stop the HTTP server."""
        if self._server is not None:
            self._server.should_exit = True
            if self._task is not None:
                await asyncio.wait([self._task], timeout=5)
            self._server = None


async def _maybe_remote(handle: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    if isinstance(handle, ActorHandle):
        return await getattr(handle, method).remote(*args, **kwargs)
    return await getattr(handle, method)(*args, **kwargs)


class _Coalescer:
    """Calls of one gateway method made in the same event-loop turn, sent as one call of its batch
    method (``create_sessions`` for ``create_session``…): a thousand sessions opened together cost
    one Ray call per gateway instead of a thousand.  An item the batch answers None for, and every
    item of a gateway without the batch method, is called alone, so results and errors are those
    of the single call.
    """

    def __init__(self, gateway: Any, single: str, batch: str) -> None:
        self.gateway, self.single, self.batch = gateway, single, batch
        self.batched = hasattr(gateway, batch)
        self.pending: list[tuple[tuple[Any, ...], asyncio.Future[Any]]] = []
        self.sending: set[asyncio.Task[None]] = set()  # strong references while in flight

    async def call(self, *args: Any) -> Any:
        """The single method's result for ``args`` (or its exception)."""
        if not self.batched:
            return await _maybe_remote(self.gateway, self.single, *args)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if not self.pending:  # the first of this turn: flush after every caller of the turn ran
            loop.call_soon(self._flush)
        self.pending.append((args, future))
        result = await future
        if result is None:
            return await _maybe_remote(self.gateway, self.single, *args)
        return result

    def _flush(self) -> None:
        batch, self.pending = self.pending, []
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self.sending.add(task)
        task.add_done_callback(self.sending.discard)

    async def _send(self, batch: list[tuple[tuple[Any, ...], asyncio.Future[Any]]]) -> None:
        try:
            results = await _maybe_remote(self.gateway, self.batch, [args for args, _ in batch])
        except BaseException as e:  # noqa: BLE001 - handed to every caller of the batch
            for _, future in batch:
                if not future.done():
                    future.set_exception(e)
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)


class GatewayManager:
    """Opens sessions on the least-busy gateway and routes later calls to the same one.

    Args:
        gateways: GatewayActor handles (or in-process, started GatewayActor objects).
    """

    def __init__(self, gateways: list[Any]) -> None:
        if not gateways:
            raise ConfigError(
                "GatewayManager needs at least one gateway (rollout.gateway.num_gateways >= 1)"
            )
        self.gateways = list(gateways)
        self.active = [0] * len(self.gateways)
        self.dead: set[int] = set()
        """Gateways whose actor died: no new session goes there (the manager replaces them before
        a batch)."""
        self.why: dict[int, str] = {}
        """Why the manager killed a gateway (e.g. it hung): said in the errors of the sessions
        that were on it."""
        self._where: dict[str, int] = {}
        self._opens = [_Coalescer(g, "create_session", "create_sessions") for g in self.gateways]
        self._closes = [_Coalescer(g, "finalize", "finalize_sessions") for g in self.gateways]

    def lost(self, index: int, reason: str) -> None:
        """The manager is about to kill gateway ``index`` for ``reason``: no new session goes there,
        and calls for the sessions on it fail with an error that says why (not only that the actor
        died)."""
        self.dead.add(index)
        self.why[index] = reason

    async def _call(self, index: int, method: str, *args: Any) -> Any:
        try:
            if method == "finalize":
                return await self._closes[index].call(*args)
            return await _maybe_remote(self.gateways[index], method, *args)
        except Exception as e:
            if index in self.why and _actor_gone(e):
                raise ServerError(f"gateway {index} {self.why[index]}") from e
            raise

    async def create_session(
        self, session_id: str | None = None, metadata: dict[str, Any] | None = None,
        sampling_params: dict[str, Any] | None = None,
    ) -> SessionHandle:
        """Open a session on the live gateway with the fewest active sessions (a gateway whose actor
        died is left out and the session opened on another)."""
        while True:
            live = [k for k in range(len(self.gateways)) if k not in self.dead]
            if not live:
                raise ServerError(
                    f"all {len(self.gateways)} gateway actor(s) died; the "
                    f"AgentLoopManager starts new "
                    "ones before its next batch"
                )
            i = min(live, key=lambda k: self.active[k])
            self.active[i] += 1  # reserved before the await, so concurrent opens spread out
            try:
                handle: SessionHandle = await self._opens[i].call(
                    session_id, metadata, sampling_params
                )
            except BaseException as e:
                self.active[i] -= 1
                if not _actor_gone(e):
                    raise
                self.dead.add(i)
                logger.warning(
                    "gateway %d died (%s); its new sessions go to the others", i, first_line(e)
                )
                continue
            self._where[handle.session_id] = i
            return handle

    async def finalize(self, session_id: str, longest_only: bool = False) -> dict[str, Any]:
        """Close a session and free its slot; returns trajectories and reward info."""
        i = self._gateway_of(session_id)
        try:
            return await self._call(i, "finalize", session_id, longest_only)
        finally:
            self._where.pop(session_id, None)
            self.active[i] -= 1

    async def abort(self, session_id: str) -> dict[str, Any]:
        """Abort a session's in-flight requests (finalize it afterwards)."""
        return await self._call(self._gateway_of(session_id), "abort", session_id)

    async def complete(
        self, session_id: str, reward_info: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Mark a session complete."""
        return await self._call(self._gateway_of(session_id), "complete", session_id, reward_info)

    async def get_state(self, session_id: str) -> dict[str, Any]:
        """A session's state and counters."""
        return await self._call(self._gateway_of(session_id), "get_state", session_id)

    def _gateway_of(self, session_id: str) -> int:
        if session_id not in self._where:
            raise KeyError(f"session {session_id!r} was not opened through this GatewayManager")
        return self._where[session_id]


def _actor_gone(error: BaseException) -> bool:
    """Whether ``error`` says the actor called is gone (died, killed, its node lost)."""
    return isinstance(error, ray.exceptions.RayActorError)


def replace_dead_gateways(gateways: list[Any], sections: GatewaySections, server_handles: list[Any],
                          balancer: Any = None, timeout: float = 30.0) -> int:
    """Look at every gateway actor; start a new one in place of each that died (``gateways`` is
    changed in place), built from ``sections`` as :func:`start_gateways` does.  Returns how many
    were replaced; a gateway slow to answer is left (it may be busy)."""
    refs = [g.num_sessions.remote() for g in gateways]
    # one wait for all, not one each
    answered = set(ray.wait(refs, num_returns=len(refs), timeout=timeout)[0])
    dead = []
    for i, ref in enumerate(refs):
        if ref not in answered:
            logger.warning(
                "gateway %d did not answer within %g s; left as it is (killed if "
                "it stays silent for "
                "rollout.server.stall_timeout while a batch runs)",
                i,
                timeout,
            )
            continue
        try:
            ray.get(ref)
        except Exception as e:  # noqa: BLE001 - only a gone actor is replaced
            if _actor_gone(e):
                logger.warning(
                    "gateway %d died (%s); starting a new one in its place", i, first_line(e)
                )
                dead.append(i)
            else:
                logger.warning("gateway %d did not answer (%s); left as it is", i, first_line(e))
    if dead:
        for i, fresh in zip(
            dead, start_gateways(sections, server_handles, balancer, n=len(dead)), strict=True
        ):
            with contextlib.suppress(Exception):
                ray.kill(gateways[i], no_restart=True)
            gateways[i] = fresh
    return len(dead)


def kill_hung_gateways(gateways: list[Any], watch: HangWatch[int], hang_s: float,
                       tell: Callable[[int, str], Any] | None = None) -> list[int]:
    """A look while a batch runs: a gateway actor that leaves a probe unanswered for ``hang_s``
    seconds has a blocked event loop (its sessions' HTTP calls hang with it) and is killed.  The
    sessions open on it end as ``error`` rows, new sessions go to the other gateways, and it is
    replaced before the next batch (:func:`replace_dead_gateways`).  ``tell(index, reason)`` runs
    before each kill (the manager tells the workers, whose rows then say the gateway hung). Returns
    the gateways killed.
    """
    hung, _ = watch.look(dict(enumerate(gateways)), lambda g: g.num_sessions.remote(), hang_s)
    for i in hung:
        logger.warning(
            "gateway %d did not answer for %g s (rollout.server.stall_timeout): "
            "its event loop is blocked; "
            "killing it (its sessions end as error rows, it is replaced before "
            "the next batch)",
            i,
            hang_s,
        )
        if tell is not None:
            tell(
                i,
                f"hung: it left a probe unanswered for {hang_s:g} s "
                f"(rollout.server.stall_timeout) and was "
                "killed; it is replaced before the next batch",
            )
        ray.kill(gateways[i], no_restart=True)
    return hung


def tell_gateways(gateways: list[Any], index: int, handle: Any) -> None:
    """Hand restarted server ``index`` to every gateway; a dead gateway is skipped (its replacement
    starts with the current servers)."""
    for gateway, ref in [(g, g.replace_server.remote(index, handle)) for g in gateways]:
        try:
            ray.get(ref, timeout=30)
        except Exception as e:  # noqa: BLE001 - a gateway's fault must not stop a server's return
            logger.warning(
                "gateway %s was not told about restarted server %d: %s", gateway, index,
                first_line(e),
            )


def start_gateways(sections: GatewaySections, server_handles: list[Any], balancer: Any = None,
                   n: int | None = None) -> list[Any]:
    """Start ``n`` (default ``sections.gateway.num_gateways``) GatewayActor actors and their HTTP
    servers.

    Raises:
        ConfigError: ``n`` is below 1.
    """
    if n is None:
        n = sections.gateway.num_gateways
    if n < 1:
        raise ConfigError(
            f"rollout.gateway.num_gateways must be >= 1 when a loop needs the gateway, got {n}"
        )
    cls = ray.remote(GatewayActor)
    actors = [
        cls.options(num_cpus=0, max_concurrency=10000).remote(sections, server_handles, balancer)
        for _ in range(n)
    ]
    urls = ray.get([a.start.remote() for a in actors])  # type: ignore[attr-defined]
    logger.info("gateways listening at %s", urls)
    return actors
