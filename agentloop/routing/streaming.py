"""The streaming half of :class:`~agentloop.routing.manager.AsyncLLMServerManager`:
``generate_stream`` (one generation as token chunks from the server routing chose, resumed across
server pauses with ``partial_rollout``), a mixin the router inherits.  Spec:
docs/routing.md#the-router-asyncllmservermanager.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ray.actor import ActorHandle

from agentloop.routing.outputs import UNCUT, with_versions
from agentloop.routing.prefix_affinity import prefix_keys
from agentloop.routing.server_errors import SERVER_CALL_ERRORS, reraise_translated
from agentloop.types import StopReason, TokenDelta, TokenOutput, with_field


class StreamingRouting:
    """``generate_stream`` for the router (a mixin: the router provides the routing)."""

    server_handles: list[Any]
    num_resumes: int
    _prefix: bool

    _acquire: Callable[..., int | Awaitable[int]]
    _release_nowait: Callable[..., None]
    _resumes: Callable[[TokenOutput | TokenDelta], bool]

    async def generate_stream(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
        image_data: list[Any] | None = None, sticky_key: str | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """Stream a generation from the server chosen for ``request_id`` (same routing as
        :meth:`generate`).

        The in-flight slot is held until the stream ends, fails, or the consumer stops iterating;
        a consumer that stops early should :meth:`abort` the request so the engine stops too.

        With ``partial_rollout`` a stream a server pause cut goes on after the resume, as
        :meth:`generate` does: the tokens of the cut piece are passed on as an ordinary chunk and
        the request is re-issued with ``prompt_ids`` plus every token so far and the rest of
        ``max_tokens``; the consumer sees one stream whose last chunk has the last piece's stop
        reason and, in ``extra_fields``, ``num_preempted`` and the ``min_global_steps`` /
        ``max_global_steps`` over the pieces. (``restart_preempted`` does not apply to streams:
        tokens already streamed cannot be taken back, so a cut stream ends ``aborted``.)
        """
        generated: list[int] = []
        # per piece: its weight version, the tokens it sampled
        pieces: list[tuple[int | None, int]] = []
        params = dict(sampling_params)
        limit = sampling_params.get("max_tokens")
        while True:
            final, before = None, len(generated)
            async for delta in self._stream_once(
                request_id, sticky_key, list(prompt_ids) + generated, params, image_data
            ):
                if delta.finished:
                    final = delta
                    continue
                generated += delta.token_ids
                yield delta
            if final is None:
                return
            version = final.extra_fields.get("global_steps")
            pieces.append(
                (
                    None if version is None else int(version),
                    len(generated) - before + len(final.token_ids),
                )
            )
            extra = dict(final.extra_fields)
            if len(pieces) > 1:
                extra["num_preempted"] = len(pieces) - 1
                known = [(v, n) for v, n in pieces if v is not None]
                # a piece cut before any token
                sampled = [v for v, n in known if n] or [v for v, _ in known]
                # does not widen the range
                if sampled:
                    extra.update(min_global_steps=min(sampled), max_global_steps=max(sampled))
            if not self._resumes(final):
                yield (
                    final
                    if len(pieces) == 1
                    else final.model_copy(update={"extra_fields": extra, **UNCUT})
                )
                return
            generated += final.token_ids
            # the cut piece's last tokens: an ordinary chunk, the stream goes on
            if final.token_ids:
                yield TokenDelta(token_ids=final.token_ids, log_probs=final.log_probs)
            limit = limit if limit is not None else final.max_tokens
            # cut after its last allowed token
            if limit is not None and int(limit) - len(generated) <= 0:
                yield TokenDelta(
                    token_ids=[], log_probs=None if final.log_probs is None else [], finished=True,
                    stop_reason=StopReason.LENGTH, extra_fields=extra,
                )
                return
            if limit is not None:
                params["max_tokens"] = int(limit) - len(generated)
            self.num_resumes += 1

    async def _stream_once(self, request_id: str, sticky_key: str | None, prompt_ids: list[int],
                           sampling_params: dict[str, Any], image_data: list[Any] | None
                           ) -> AsyncIterator[TokenDelta]:
        kwargs = {
            "prompt_ids": prompt_ids, "sampling_params": sampling_params, "request_id": request_id,
            "image_data": image_data,
        }
        prefix = prefix_keys(prompt_ids) if self._prefix else ()
        async with self._slot(
            sticky_key or request_id, len(prompt_ids), request_id, prefix
        ) as server:
            handle = self.server_handles[server]
            if isinstance(handle, ActorHandle):
                refs: Any = handle.generate_stream.options(num_returns="streaming").remote(**kwargs)
                async for ref in refs:
                    yield self._tag(await ref, server)
            else:
                async for delta in handle.generate_stream(**kwargs):
                    yield self._tag(delta, server)

    @contextlib.asynccontextmanager
    async def _slot(
        self, key: str, prompt_len: int, request_id: str, prefix: tuple[int, ...] = ()
    ) -> AsyncIterator[int]:
        """Hold an in-flight slot on the server chosen for ``key``; released on success, error and
        cancellation alike.  A dead server actor becomes a ServerDeadError; an error raised inside
        the server propagates as the server raised it (out of Ray's task-error wrapper:
        :func:`~agentloop.routing.server_errors.translated`).
        """
        chosen = self._acquire(key, prompt_len, prefix)
        server = chosen if isinstance(chosen, int) else await chosen
        cancelled = False
        try:
            yield server
        except (asyncio.CancelledError, GeneratorExit):
            cancelled = True
            raise
        except SERVER_CALL_ERRORS as e:
            reraise_translated(e, server, request_id)
        finally:
            self._release_nowait(server, cancelled=cancelled)

    @staticmethod
    def _tag(delta: TokenDelta, server: int) -> TokenDelta:
        if not delta.finished:
            return delta
        return with_field(delta, "extra_fields", with_versions(delta.extra_fields, server))

