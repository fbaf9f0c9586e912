"""Branch-aware trajectory store of one gateway session: a prefix trie over canonicalised messages.

An external agent sends the whole message list on every chat request; :meth:`SessionStore.prepare`
finds the longest branch the request continues and encodes only the new suffix (raises
:class:`StoreError` for a request it cannot place), :meth:`~SessionStore.commit` records the
engine's sampled ids exactly, and :meth:`~SessionStore.trajectories` returns every root-to-leaf path
as a token-exact RL trajectory (mask 1 on sampled ids, ending with a sampled id).  Not thread-safe
(one asyncio loop). Canonical messages live in :mod:`agentloop.gateway.canonical` (re-exported
here).  Spec (canonical messages, node kinds, placement, fallbacks): docs/gateway.md#the-trie.
"""

from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentloop.batch.routed_experts import path_rows
from agentloop.errors import AgentLoopError
from agentloop.gateway.canonical import Canon, canonical_message, canonical_tools
from agentloop.gateway.images import ImageEncoder
from agentloop.tokenization.incremental import (
    TemplateMismatchError,
    assistant_text,
    encode_new_turns,
)

logger = logging.getLogger(__name__)

Key = tuple[str, tuple[Canon, ...]]


class StoreError(AgentLoopError, ValueError):
    """A request the store cannot place or a misuse of a reservation (the gateway answers 400)."""


def _placeable(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as a list; :class:`StoreError` when empty or ending with an assistant
    message."""
    messages = list(messages)
    if not messages:
        raise StoreError("messages is empty: send at least one message")
    if messages[-1].get("role") == "assistant":
        raise StoreError(
            "the last message is an assistant message; continuing a partial "
            "assistant turn is not "
            "supported: end the request with a user, system or tool message"
        )
    return messages


# ---- nodes
# -------------------------------------------------------------------------------------------
@dataclass(eq=False)
class ContextNode:
    """A run of messages the policy did not sample; ``ids`` end with the generation prompt."""

    parent: SampledNode | None  # None: a child of the root
    key: Key
    messages: list[dict[str, Any]]
    ids: list[int]
    seq: int
    samples: list[SampledNode] = field(default_factory=list)
    pending: int = 0
    # encoded image files of the image parts, in order
    images: list[bytes] = field(default_factory=list)


@dataclass(eq=False)
class SampledNode:
    """One assistant turn the engine generated, exactly as sampled."""

    parent: ContextNode
    ids: list[int]
    log_probs: list[float] | None
    message: dict[str, Any]
    finish_reason: str
    canon: Canon
    seq: int
    children: dict[Key, ContextNode] = field(default_factory=dict)
    budget_spent: bool = False
    """A request continuing this turn found no response budget left
    (:meth:`SessionStore.release_spent`)."""
    constrained: bool = False
    """Sampled under a grammar (tool_choice / response_format,
    docs/gateway.md#tool-choice-and-structured-output)."""
    routed: tuple[int, Any] | None = None  # routing replay: (start, rows) by path position


@dataclass
class Reservation:
    """A request placed in the trie, waiting for its generation.

    Attributes:
        node: the context node the generation continues.
        prompt_ids: every id on the path from the root to ``node``: what the engine must continue.
        num_encoded_tokens: ids encoded for this request (0 when the context node was reused).
        remaining: ``max_length - len(prompt_ids)``; may be zero or negative.
        prompt_len: ids of the branch's first context node (what a trajectory row calls the prompt);
            ``len(prompt_ids) - prompt_len`` is the response budget the branch has used so far.
        images: the encoded image files on the path, in order: the engine's ``image_data``.
    """

    node: ContextNode
    prompt_ids: list[int]
    num_encoded_tokens: int
    remaining: int
    prompt_len: int = 0
    done: bool = False
    images: list[bytes] = field(default_factory=list)

    @property
    def response_used(self) -> int:
        """Response tokens (sampled and context) already on this branch, including the new
        context."""
        return len(self.prompt_ids) - self.prompt_len


@dataclass
class Trajectory:
    """One root-to-leaf path: the prompt, then sampled turns and the context between them."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float] | None
    messages: list[dict[str, Any]]
    num_turns: int
    finish_reason: str
    # {"image": [encoded files]} of the path, in order
    multi_modal_data: dict[str, list[bytes]] | None = None
    # a sampled turn of it was sampled under a grammar (tool_choice / response_format)
    constrained: bool = False
    routed_experts: Any | None = None  # routing replay: rows of prompt_ids + response_ids


# ---- the store
# ---------------------------------------------------------------------------------------
class SessionStore:
    """The prefix trie of one session (docs/gateway.md#the-trie).

    Args:
        tokenizer: the served model's tokenizer (``apply_chat_template``, ``encode``).
        max_length: per-trajectory token budget, ``prompt_length + response_length``.
        end_of_turn: the token(s) the engine ends a turn with (default ``tokenizer.eos_token``); the
            first one is inserted after a sample that ended without any of them.
        chat_template_kwargs: extra template variables passed to every render.
        images: decodes and places image parts (default: a text-only model, which refuses them).
    """

    def __init__(
        self, tokenizer: Any, *, max_length: int, end_of_turn: str | Sequence[str] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None, images: ImageEncoder | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_length = int(max_length)
        stops = end_of_turn if end_of_turn is not None else tokenizer.eos_token
        self._stops: tuple[str, ...] = (stops,) if isinstance(stops, str) else tuple(stops)
        self._stop_ids = {token: self._token_id(token) for token in self._stops}
        self._stop_by_id = {i: token for token, i in self._stop_ids.items()}
        self._kwargs = dict(chat_template_kwargs or {})
        self._media = images if images is not None else ImageEncoder()
        self._roots: dict[Key, ContextNode] = {}
        self._seq = itertools.count()
        self._num_encoded = 0
        self._num_reused = 0
        self._num_fallbacks = 0

    def _token_id(self, token: str) -> int:
        ids = list(self.tokenizer.encode(token, add_special_tokens=False))
        if len(ids) != 1:
            raise StoreError(
                f"end-of-turn {token!r} is not a single token of this tokenizer: {ids}"
            )
        return int(ids[0])

    # ---- requests
    # ----------------------------------------------------------------------------------
    def prepare(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> Reservation:
        """Place a request: match the deepest branch, encode only the new suffix, reserve its
        context node.

        Raises:
            StoreError: no messages, or the last message is an assistant message.
        """
        messages = _placeable(messages)
        canon = [canonical_message(m) for m in messages]
        tools_key = canonical_tools(tools)
        parent, start = self._match(canon, tools_key, messages, tools)
        node, encoded = self._context(parent, messages, canon, start, tools, tools_key)
        node.pending += 1
        path = self._path(node)
        prompt = [t for part in path for t in part.ids]
        return Reservation(
            node=node, prompt_ids=prompt, num_encoded_tokens=encoded,
            remaining=self.max_length - len(prompt), prompt_len=len(path[0].ids),
            images=[i for part in path if isinstance(part, ContextNode) for i in part.images],
        )

    def count_prompt_tokens(self, messages: Sequence[dict[str, Any]],
                            tools: Sequence[dict[str, Any]] | None = None) -> int:
        """Length of the prompt :meth:`prepare` would give ``messages`` now; nothing is placed or
        counted.

        Raises:
            StoreError: as :meth:`prepare`.
        """
        messages = _placeable(messages)
        canon = [canonical_message(m) for m in messages]
        tools_key = canonical_tools(tools)
        parent, start = self._match(canon, tools_key, messages, tools)
        existing = self._children(parent).get((tools_key, tuple(canon[start:])))
        if existing is not None:
            return sum(len(part.ids) for part in self._path(existing))
        tool_list = list(tools) if tools else None
        if parent is not None:
            try:
                suffix = self._encode_after(parent, messages, start, tool_list)
            except TemplateMismatchError:  # prepare falls back to a full render too
                return len(self._encode_full(messages, tool_list))
            return sum(len(part.ids) for part in self._path(parent)) + len(suffix)
        return len(self._encode_full(messages, tool_list))

    def commit(
        self, reservation: Reservation, token_ids: Sequence[int], log_probs: Sequence[float] | None,
        message: dict[str, Any], finish_reason: str, constrained: bool = False,
        routed: tuple[int, Any] | None = None,
    ) -> SampledNode:
        """Record a generation as a new sampled child (always a new sibling) of the reservation's
        node; ``constrained``: the engine sampled it under a grammar; ``routed``: its routed
        experts (:func:`~agentloop.batch.routed_experts.call_rows`).

        Raises:
            StoreError: the reservation was already committed or released, or ``log_probs`` is not
                aligned with ``token_ids`` (the reservation is then released).
        """
        if log_probs is not None and len(log_probs) != len(token_ids) and not reservation.done:
            self.release(reservation)
            raise StoreError(
                f"{len(log_probs)} logprobs for {len(token_ids)} token ids; nothing was recorded"
            )
        self._finish(reservation)
        message = copy.deepcopy({"role": "assistant", **message})
        node = SampledNode(
            parent=reservation.node, ids=[int(t) for t in token_ids],
            log_probs=None if log_probs is None else [float(x) for x in log_probs], message=message,
            finish_reason=finish_reason, canon=canonical_message(message), seq=next(self._seq),
            constrained=constrained, routed=routed,
        )
        reservation.node.samples.append(node)
        return node

    def known_routing(self, reservation: Reservation) -> Any | None:
        """The routed-experts rows the reservation's path already has (None: none)."""
        return path_rows([p.routed for p in self._path(reservation.node)
                          if isinstance(p, SampledNode)])

    def release(self, reservation: Reservation) -> None:
        """Give up a reservation (failed request): nothing is recorded; a context node nothing
        sampled from and nothing waits on is removed.  Releasing twice, or after a commit, does
        nothing."""
        if reservation.done:
            return
        self._finish(reservation)
        node = reservation.node
        if node.samples or node.pending:
            return
        siblings = self._children(node.parent)
        if siblings.get(node.key) is node:
            del siblings[node.key]

    def release_spent(self, reservation: Reservation) -> None:
        """Release a reservation whose branch has no response budget left: its new context is
        dropped (as ``tool_agent`` drops a tool turn that does not fit) and the sampled turn it
        continued is marked, so that turn's trajectory reports ``finish_reason`` ``length``."""
        parent = reservation.node.parent
        self.release(reservation)
        if parent is not None:
            parent.budget_spent = True

    def _finish(self, reservation: Reservation) -> None:
        if reservation.done:
            raise StoreError("this reservation was already committed or released")
        reservation.done = True
        reservation.node.pending -= 1

    # ---- matching
    # ----------------------------------------------------------------------------------
    def _children(self, node: SampledNode | None) -> dict[Key, ContextNode]:
        return self._roots if node is None else node.children

    def _match(
        self, canon: list[Canon], tools_key: str, messages: Sequence[dict[str, Any]] | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> tuple[SampledNode | None, int]:
        """The deepest sampled node whose path equals a prefix of ``canon``, and where that prefix
        ends.

        Depth-first over every context child whose run equals the next messages and is followed by
        an assistant message equal to one of its samples (:meth:`_same_turn`: with ``messages``, one
        sent without its sample's reasoning matches where the template drops that reasoning anyway);
        on a tie the earliest branch wins.
        """
        best: SampledNode | None = None
        best_end = 0
        stack: list[tuple[SampledNode | None, int]] = [(None, 0)]
        while stack:
            node, start = stack.pop()
            if start > best_end:
                best, best_end = node, start
            found: list[tuple[SampledNode | None, int]] = []
            for ctx in self._children(node).values():
                key_tools, run = ctx.key
                end = start + len(run)
                if key_tools != tools_key or end >= len(canon) or tuple(canon[start:end]) != run:
                    continue
                found += [(s, end + 1) for s in ctx.samples
                          if self._same_turn(s, canon, end, messages, tools)]
            stack.extend(reversed(found))
        return best, best_end

    def _same_turn(
        self, sample: SampledNode, canon: list[Canon], k: int,
        messages: Sequence[dict[str, Any]] | None, tools: Sequence[dict[str, Any]] | None,
    ) -> bool:
        """Whether request message ``k`` is the turn ``sample``: equal canonical forms, or the
        client left out the sample's reasoning (and nothing else) and the template renders the
        request the same with it put back: it drops that past reasoning anyway
        (docs/gateway.md#reasoning)."""
        sent = canon[k]
        if sample.canon == sent:
            return True
        if messages is None or sent[4] or not sample.canon[4] or sample.canon[:4] != sent[:4]:
            return False
        restored = list(messages)
        restored[k] = {**messages[k], "reasoning_content": sample.message.get("reasoning_content")}
        tool_list = list(tools) if tools else None
        try:
            return self._render(restored, tool_list) == self._render(list(messages), tool_list)
        except Exception:  # a template that cannot render the request: no match, prepare reports it
            return False

    def _context(
        self, parent: SampledNode | None, messages: list[dict[str, Any]], canon: list[Canon],
        start: int, tools: Sequence[dict[str, Any]] | None, tools_key: str,
    ) -> tuple[ContextNode, int]:
        """The context node for ``messages[start:]`` under ``parent``: an existing equal one, or
        a new one."""
        key: Key = (tools_key, tuple(canon[start:]))
        existing = self._children(parent).get(key)
        if existing is not None:
            self._num_reused += 1
            return existing, 0
        tool_list = list(tools) if tools else None
        if parent is None:
            ids = self._encode_full(messages, tool_list)
        else:
            try:
                ids = self._encode_after(parent, messages, start, tool_list)
            except TemplateMismatchError as e:
                logger.warning("incremental encoding is not exact for this request, starting a "
                               "new tree with a full render: %s", e)
                self._num_fallbacks += 1
                return self._context(None, messages, canon, 0, tools, tools_key)
        node = ContextNode(
            parent=parent, key=key, messages=copy.deepcopy(messages[start:]), ids=ids,
            seq=next(self._seq), images=self._media.sources(messages[start:], start),
        )
        self._children(parent)[key] = node
        self._num_encoded += len(ids)
        return node, len(ids)

    # ---- encoding
    # ----------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        """The template's text for ``messages`` with the generation prompt."""
        return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                  tokenize=False, **self._kwargs)

    def _encode_full(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        return self._media.expand(self._encode(self._render(messages, tools)), messages)

    def _encode_after(self, parent: SampledNode, messages: list[dict[str, Any]], start: int,
                      tools: list[dict[str, Any]] | None) -> list[int]:
        """Ids of ``messages[start:]`` after the sampled turn ``parent``
        (docs/gateway.md#the-trie)."""
        system = messages[0] if messages[0].get("role") == "system" else None
        ids: list[int] = []
        stop = self._stop_by_id.get(parent.ids[-1]) if parent.ids else None
        if stop is None:  # cut by the length limit: close the turn as the template would
            stop = self._stops[0]
            ids.append(self._stop_ids[stop])
        previous = parent.message
        run: list[dict[str, Any]] = []
        for msg in messages[start:]:
            if msg.get("role") != "assistant":
                run.append(msg)
                continue
            ids += encode_new_turns(
                self.tokenizer, run, system=system, tools=tools, previous=previous,
                end_of_turn=stop, chat_template_kwargs=self._kwargs,
            )
            text, stop = assistant_text(self.tokenizer, msg, tools, self._stops, self._kwargs)
            ids += self._encode(text) + [self._stop_ids[stop]]
            previous, run = msg, []
        ids += encode_new_turns(self.tokenizer, run, system=system, tools=tools, previous=previous,
                                end_of_turn=stop, chat_template_kwargs=self._kwargs)
        return self._media.expand(ids, messages[start:], start)

    @staticmethod
    def _path(node: ContextNode | SampledNode) -> list[ContextNode | SampledNode]:
        chain: list[ContextNode | SampledNode] = []
        current: ContextNode | SampledNode | None = node
        while current is not None:
            chain.append(current)
            current = current.parent
        return chain[::-1]

    # ---- results
    # -----------------------------------------------------------------------------------
    def _contexts(self) -> Iterator[ContextNode]:
        stack = list(self._roots.values())
        while stack:
            ctx = stack.pop()
            yield ctx
            stack += [c for s in ctx.samples for c in s.children.values()]

    def _leaves(self) -> list[SampledNode]:
        leaves = [s for ctx in self._contexts() for s in ctx.samples
                  if not any(c.samples for c in s.children.values())]
        return sorted(leaves, key=lambda s: s.seq)

    def trajectories(self, longest_only: bool = False) -> list[Trajectory]:
        """One trajectory per sampled node without sampled descendants, in the leaves' creation
        order.

        ``longest_only`` keeps only the one with the most response tokens (the first of equals).
        """
        result = [self._trajectory(leaf) for leaf in self._leaves()]
        if longest_only and result:
            return [max(result, key=lambda t: len(t.response_ids))]
        return result

    def _trajectory(self, leaf: SampledNode) -> Trajectory:
        first, *rest = self._path(leaf)
        response: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        has_logprobs = True
        messages: list[dict[str, Any]] = []
        messages += first.messages if isinstance(first, ContextNode) else []
        for part in rest:
            response += part.ids
            if isinstance(part, SampledNode):
                mask += [1] * len(part.ids)
                has_logprobs = has_logprobs and part.log_probs is not None
                logprobs += part.log_probs or []
                messages.append(part.message)
            else:
                mask += [0] * len(part.ids)
                logprobs += [0.0] * len(part.ids)
                messages += part.messages
        # drop context after the last sampled id
        end = max((k + 1 for k, m in enumerate(mask) if m), default=0)
        images = [i for part in [first, *rest] if isinstance(part, ContextNode)
                  for i in part.images]
        routed = path_rows([p.routed for p in rest if isinstance(p, SampledNode)])
        return Trajectory(
            prompt_ids=list(first.ids), response_ids=response[:end], response_mask=mask[:end],
            response_logprobs=logprobs[:end] if has_logprobs else None,
            messages=copy.deepcopy(messages), num_turns=len(messages),
            finish_reason="length" if leaf.budget_spent else leaf.finish_reason,
            multi_modal_data={"image": images} if images else None,
            constrained=any(p.constrained for p in rest if isinstance(p, SampledNode)),
            routed_experts=None if routed is None else routed[:len(first.ids) + end],
        )

    def stats(self) -> dict[str, int]:
        """Counters for metrics: nodes, sampled nodes, trajectories, tokens encoded, reuses,
        fallbacks."""
        contexts = list(self._contexts())
        sampled = sum(len(c.samples) for c in contexts)
        return {
            "num_nodes": len(contexts) + sampled, "num_context_nodes": len(contexts),
            "num_sampled_nodes": sampled, "num_trajectories": len(self._leaves()),
            "num_pending": sum(c.pending for c in contexts),
            "num_encoded_tokens": self._num_encoded, "num_reused_contexts": self._num_reused,
            "num_fallbacks": self._num_fallbacks,
        }
