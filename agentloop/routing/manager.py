"""AsyncLLMServerManager: the async client agent loops call to generate.

``generate(request_id, *, prompt_ids, sampling_params, image_data=None) -> TokenOutput``: acquire a
server from the balancer (sticky by request id, else least in-flight), call it, and release the
in-flight slot when the call ends (success, error or cancellation).  A request whose server died
fails over to another server with the same prompt ids; with ``partial_rollout`` a generation a
server pause cut is resumed and the pieces joined.  Spec (failover, partial rollouts, output fields,
verl's extra keywords): docs/routing.md#the-router-asyncllmservermanager.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Sequence
from typing import Any, NoReturn, cast

from ray.actor import ActorHandle

from agentloop.errors import RoutingError
from agentloop.report import timing
from agentloop.routing.balancer_actor import RemoteBalancer
from agentloop.routing.batcher import ServerCallBatcher
from agentloop.routing.outputs import UNCUT, join_pieces, trace_generate, with_versions
from agentloop.routing.prefix_affinity import build_balancer, prefix_keys
from agentloop.routing.server_errors import (  # noqa: F401 (server_cause, server_errors: re-export)
    SERVER_CALL_ERRORS,
    reraise_translated,
    server_cause,
    server_errors,
    translated,
)
from agentloop.routing.strategies import Balancer
from agentloop.routing.streaming import StreamingRouting
from agentloop.servers.base import ServerDeadError
from agentloop.trace import enabled as trace_enabled
from agentloop.types import (
    StopReason,
    TokenDelta,
    TokenOutput,
    assign_field,
    with_field,
)

logger = logging.getLogger(__name__)


class AsyncLLMServerManager(StreamingRouting):
    """Routes token-in/token-out requests over several servers.

    Args:
        server_handles: Ray actor handles or in-process LLMServer objects.
        balancer: a GlobalBalancer actor handle or a local Balancer (default: a new local one).
        max_cache_size: sticky LRU size for the default local balancer.
        batch_calls: send the generate calls of one event-loop iteration for one server actor as one
        Ray call. owner: who holds this client's in-flight slots in a shared balancer (default: a
        fresh id). max_failovers: how many times one request may move on after its server died
        (default: once to every
            other server).
        partial_rollout: resume generations a server pause interrupted and join the pieces; False
        returns them
            ``aborted``, or with ``restart_preempted`` runs them again from their start.
        priority: ``(request_id, prompt_len) -> int`` sent as ``sampling_params["priority"]`` (e.g.
            :class:`agentloop.routing.tail.ContextPriority`); None: arrival order.
        routing: ``server.routing``: ``prefix`` sends each prompt's prefix keys with the acquire
            (:func:`~agentloop.routing.prefix_affinity.prefix_keys`) and builds the default local
            balancer as :class:`~agentloop.routing.prefix_affinity.PrefixAffinity`; ``sticky``
            (default) sends none.

    Raises:
        RoutingError: ``server_handles`` is empty.

    Spec: docs/routing.md; pauses and partial rollouts: docs/async.md.
    """

    def __init__(
        self, server_handles: Sequence[Any], balancer: Balancer | ActorHandle | None = None, *,
        max_cache_size: int = 10000, batch_calls: bool = True, owner: str | None = None,
        max_failovers: int | None = None, partial_rollout: bool = False,
        restart_preempted: bool = False, priority: Any = None, routing: str = "sticky",
    ) -> None:
        self.server_handles = list(server_handles)
        self.priority = priority
        if not self.server_handles:
            raise RoutingError(
                "no servers to route to: AsyncLLMServerManager got an empty server_handles list"
            )
        self.balancer: Any = balancer if balancer is not None else build_balancer(
            len(self.server_handles), routing=routing, max_cache_size=max_cache_size
        )
        self._prefix = routing == "prefix"
        """Send prefix keys (``server.routing: prefix``); off, the hot path computes none."""
        self.owner = owner or uuid.uuid4().hex
        self._remote_balancer = isinstance(self.balancer, ActorHandle)
        self._client = RemoteBalancer(self.balancer, self.owner) if self._remote_balancer else None
        self._batch_calls = batch_calls
        self._batchers = {
            i: ServerCallBatcher(h, i) for i, h in enumerate(self.server_handles)
            if batch_calls and isinstance(h, ActorHandle)
        }
        self.max_failovers = (
            len(self.server_handles) - 1 if max_failovers is None else int(max_failovers)
        )
        self.down: set[int] = set()
        """Servers this client saw die (and has not seen replaced)."""
        self.num_failovers = 0
        """Requests re-sent to another server after theirs died (reported in the batch's fault
        metrics)."""
        self.partial_rollout = bool(partial_rollout)
        self.restart_preempted = bool(restart_preempted) and not self.partial_rollout
        self.num_restarts = 0
        """Generations run again from their start after a server pause interrupted them
        (``restart_preempted``)."""
        self.num_resumes = 0
        """Generations re-issued after a server pause interrupted them (``partial_rollout``)."""

    def _acquire(
        self, request_id: str, prompt_len: int, prefix: tuple[int, ...] = ()
    ) -> int | Awaitable[int]:
        """The server for a request: its index from this client's own balancer at once, or an
        awaitable of it from a shared balancer actor."""
        if self._client is not None:
            return self._client.acquire(request_id, prompt_len, prefix)
        if prefix:
            return cast(int, self.balancer.acquire(request_id, prompt_len, prefix=prefix))
        return cast(int, self.balancer.acquire(request_id, prompt_len))

    def _release_nowait(self, server: int, *, cancelled: bool = False) -> None:
        """Release without awaiting; on cancellation an actor release is submitted at once."""
        if self._client is not None:
            self._client.release(server, now=cancelled)
        else:
            self.balancer.release(server)

    async def _call(self, server: int, method: str, **kwargs: Any) -> Any:
        """Call ``method`` on server ``server``, awaiting an actor call or a local coroutine
        alike."""
        return await self._start(server, method, kwargs)

    def _start(self, server: int, method: str, kwargs: dict[str, Any]) -> Awaitable[Any]:
        """Start ``method`` on server ``server``: what to await for its result (an actor call's
        reference, the batcher's future, a local server's coroutine).  The router's hot path
        awaits it directly, one coroutine less per call than :meth:`_call`."""
        if not 0 <= server < len(self.server_handles):
            raise RoutingError(
                f"the balancer chose server {server} but this manager has "
                f"{len(self.server_handles)} servers; "
                "create the GlobalBalancer with num_servers equal to the number of server handles"
            )
        handle = self.server_handles[server]
        if method == "generate" and server in self._batchers:
            return self._batched(handle, self._batchers[server].submit(kwargs), kwargs)
        if isinstance(handle, ActorHandle):
            return cast(Awaitable[Any], getattr(handle, method).remote(**kwargs))
        return cast(Awaitable[Any], getattr(handle, method)(**kwargs))

    @staticmethod
    async def _batched(handle: Any, future: Awaitable[Any], kwargs: dict[str, Any]) -> Any:
        """A batched generate call's result; when the caller gives up (timeout, abort) the engine
        request is aborted too."""
        try:
            return await future
        except asyncio.CancelledError:
            handle.abort.remote(request_id=kwargs["request_id"])
            raise

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
        image_data: list[Any] | None = None, sticky_key: str | None = None,
        video_data: list[Any] | None = None, audio_data: list[Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        mm_processor_output: list[dict[str, Any]] | None = None, priority: int = 0, **kwargs: Any,
    ) -> TokenOutput:
        """Generate on the server chosen for ``request_id``.

        Spec: docs/routing.md#the-router-asyncllmservermanager.  ``sticky_key`` (default:
        ``request_id``) is what routing sticks by, for callers whose concurrent requests need
        distinct engine request ids but one server (the gateway's sessions).  Returns one
        TokenOutput (the pieces of a resumed generation joined), with ``server_index`` and the
        weight versions in ``extra_fields``.  verl 0.7–0.9's extra keywords (``video_data``,
        ``audio_data``, ``mm_processor_kwargs``, ...) are accepted; ``video_data`` is passed on.

        Raises:
            ServerDeadError: the server died and no failover is left (``max_failovers`` used, or
            every
                server down).
            NotImplementedError: ``audio_data`` given, or ``video_data`` to a server without it.
            Exception: any other error the server raised, as it raised it (not Ray's wrapper).
        """
        if audio_data:
            raise NotImplementedError(
                "AsyncLLMServerManager.generate got audio_data: agentloop passes images and "
                "videos to the "
                "engine but not audio yet (docs/porting-from-verl.md, 'Remaining differences')"
            )
        media = {"image_data": image_data}
        if video_data:
            media["video_data"] = video_data
        key = sticky_key or request_id
        if self.priority is not None:  # the engines run with scheduling_policy=priority
            rank = int(priority) or int(self.priority(key, len(prompt_ids)))
            if rank:
                sampling_params = {**sampling_params, "priority": rank}
        try:
            output, server = await self._generate_once(
                request_id, key, prompt_ids, sampling_params, media
            )
        except TypeError as e:  # a server whose generate() has no video_data keyword
            if video_data and "video_data" in str(e):
                raise NotImplementedError(
                    f"the server does not take video_data ({e}); serve with vLLM"
                ) from e
            raise
        while self.restart_preempted and output.preempted_by_pause and not output.cut_by_update:
            self.num_restarts += 1
            output, server = await self._generate_once(
                request_id, key, prompt_ids, sampling_params, media
            )
        pieces = [output]
        if self._resumes(output):  # a cut piece to resume: not on the hot path
            pieces, server = await self._resume(
                request_id, key, prompt_ids, sampling_params, media, output, server
            )
        output = join_pieces(pieces) if self.partial_rollout or len(pieces) > 1 else pieces[0]
        fields = with_versions(output.extra_fields, server)
        if output is pieces[0] and isinstance(self.server_handles[server], ActorHandle):
            # unpickled for this call: no one else holds it
            assign_field(output, "extra_fields", fields)
            return output
        return with_field(output, "extra_fields", fields)

    async def _resume(
        self, request_id: str, key: str, prompt_ids: list[int], sampling_params: dict[str, Any],
        media: dict[str, Any], output: TokenOutput, server: int,
    ) -> tuple[list[TokenOutput], int]:
        """The pieces of a generation whose first piece is ``output`` (from ``server``): while a
        piece was cut and :meth:`_resumes` says it goes on, re-issue it with the prompt plus the
        tokens so far and the rest of ``max_tokens``.  A piece cut after its last allowed token ends
        the generation ``length``. Returns the pieces and the server of the last one."""
        pieces = [output]
        while self._resumes(output):
            generated = [t for piece in pieces for t in piece.token_ids]
            limit = pieces[0].max_tokens or sampling_params.get("max_tokens")
            params = dict(sampling_params)
            if limit is not None:
                # cut after its last allowed token: nothing is left
                if int(limit) - len(generated) <= 0:
                    pieces[-1] = output.model_copy(
                        update={"stop_reason": StopReason.LENGTH, **UNCUT}
                    )
                    break
                params["max_tokens"] = int(limit) - len(generated)
            self.num_resumes += 1
            logger.debug(
                "request %s: interrupted by a server pause after %d tokens; resuming", request_id,
                len(generated),
            )
            output, server = await self._generate_once(
                request_id, key, list(prompt_ids) + generated, params, media
            )
            pieces.append(output)
        return pieces, server

    def _resumes(self, piece: TokenOutput | TokenDelta) -> bool:
        """Whether a piece a server pause cut goes on after the resume: with ``partial_rollout``, or
        when a weight update cut it (``cut_by_update``: ``server.weight_update: abort``, resumed
        whatever ``partial_rollout`` says, as verl's fully-async parameter sync does)."""
        return piece.preempted_by_pause and (self.partial_rollout or piece.cut_by_update)

    async def _generate_once(
        self, request_id: str, key: str, prompt_ids: list[int], sampling_params: dict[str, Any],
        media: dict[str, Any],
    ) -> tuple[TokenOutput, int]:
        """One server call, failing over to another server when the chosen one is dead."""
        attempt = 0
        while True:
            try:
                chosen = self._acquire(
                    key, len(prompt_ids), prefix_keys(prompt_ids) if self._prefix else ()
                )
                server = chosen if isinstance(chosen, int) else await chosen
                start = timing.now()
                try:
                    output = await self._start(server, "generate", {
                        "prompt_ids": prompt_ids, "sampling_params": sampling_params,
                        "request_id": request_id, **media,
                    })
                except BaseException as e:
                    self._call_failed(e, server, request_id)
                self._release_nowait(server)
                self._record(request_id, server, start, prompt_ids, output)
                return output, server
            except ServerDeadError as e:
                await self._mark_down(e)
                if attempt >= self.max_failovers or len(self.down) >= len(self.server_handles):
                    raise
                attempt += 1
                self.num_failovers += 1
                logger.warning("request %s: %s; failing over to another server", request_id, e)

    def _call_failed(self, error: BaseException, server: int, request_id: str) -> NoReturn:
        """A call to ``server`` raised ``error``: its slot released (at once to a shared balancer
        when cancelled), then ``error`` raised, translated (:func:`reraise_translated`)."""
        self._release_nowait(server, cancelled=isinstance(error, asyncio.CancelledError))
        if isinstance(error, SERVER_CALL_ERRORS):
            reraise_translated(error, server, request_id)
        raise error

    @staticmethod
    def _record(
        request_id: str, server: int, start: float, prompt_ids: list[int], output: TokenOutput
    ) -> None:
        timing.record_generate(server, start, len(prompt_ids), output)  # for `agentloop report`
        if trace_enabled():
            trace_generate(request_id, server, start, prompt_ids, output)

    async def _mark_down(self, error: ServerDeadError) -> None:
        """Take the dead server out of routing, for this client and (shared balancer) every
        other."""
        server = error.server
        if server is None or server in self.down:
            return
        self.down.add(server)
        if self._remote_balancer:
            await self.balancer.mark_down.remote(server)
        else:
            self.balancer.mark_down(server)

    def mark_down(self, index: int) -> None:
        """Stop routing to server ``index`` (the manager found it dead): this client's own balancer
        (worker-local routing); a shared balancer actor is told once, by the manager."""
        self.down.add(index)
        if not self._remote_balancer:
            self.balancer.mark_down(index)

    def ensure_cache_capacity(self, entries: int) -> int:
        """Grow this client's own sticky cache to at least ``entries`` bindings and return its
        capacity; 0 with a shared balancer actor (the manager grows that one)."""
        if self._remote_balancer:
            return 0
        return int(self.balancer.ensure_cache_capacity(int(entries)))

    def replace_server(self, index: int, handle: Any) -> None:
        """Use ``handle`` (a restarted server) as server ``index`` from now on and route to it
        again."""
        self.server_handles[index] = handle
        self._batchers.pop(index, None)
        if self._batch_calls and isinstance(handle, ActorHandle):
            self._batchers[index] = ServerCallBatcher(handle, index)
        self.down.discard(index)
        if not self._remote_balancer:
            self.balancer.mark_up(index)  # a shared balancer actor is told once, by the manager

    async def abort(self, request_id: str, sticky_key: str | None = None) -> None:
        """Abort ``request_id`` on the server it is bound to (no-op if unknown); pass the
        ``sticky_key`` it was generated with, if any."""
        key = sticky_key or request_id
        if self._remote_balancer:
            server = await self.balancer.lookup.remote(key)
        else:
            server = self.balancer.lookup(key)
        if server is not None:
            await self._call(server, "abort", request_id=request_id)

    def _choose_server(self, request_id: str) -> Any:
        """verl 0.5–0.7 exposed the chosen server actor (with ``get_server_address``) for loops that
        talk to its OpenAI HTTP server.  agentloop's engines have no HTTP server: point an OpenAI
        client at the gateway (``openai_agent`` loops, docs/gateway.md) instead."""
        raise NotImplementedError(
            "AsyncLLMServerManager._choose_server / get_server_address (verl 0.5-0.7): "
            "agentloop servers have no "
            "OpenAI HTTP address; run OpenAI-client agents through the gateway "
            "(docs/gateway.md) or call "
            "server_manager.generate (docs/porting-from-verl.md#not-provided)"
        )

    async def stats(self) -> dict[str, list[int]]:
        """The balancer's in-flight and routed counts."""
        if self._remote_balancer:
            return await self.balancer.stats.remote()
        return self.balancer.stats()


LLMServerClient = AsyncLLMServerManager
"""verl 0.9's name for the router client agent loops receive as ``server_manager``."""
