"""verl 0.9's "continuous token" interface, built on agentloop's exact incremental encoding.

verl 0.9 loops keep one running token list (prompt + everything after it) and grow it with three
calls on ``AgentLoopBase``: ``ct_build_initial_tokens`` (render the prompt),
``ct_merge_assistant_token`` (append sampled ids, mask 1) and ``ct_merge_context_msg`` (append tool
/ user messages, mask 0). Each merge returns a :class:`MergeResult` and the response mask /
log-probs aligned with it.

Here the context ids come from :func:`agentloop.tokenization.encode_new_turns`: the difference
between two renders of a stand-in conversation plus the template's separator after the end-of-turn
token, so the running list equals a full chat-template render of the conversation (tests check this
per template family).  One addition to verl's behaviour: when the previous assistant turn did not
end with an end-of-turn token (cut by ``max_tokens``), that token is inserted first (mask 0), as the
full render has it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from agentloop.loops.prompt import apply_chat_template
from agentloop.tokenization import encode_new_turns, turn_separator

MergeKind = Literal["assistant", "context"]
APPEND_ROLES = frozenset({"tool", "user", "system", "assistant"})


@dataclass(frozen=True)
class MergeResult:
    """The running ids after a merge, and what the merge did at the junction.

    ``appended_token_count`` counts the new sampled (``assistant``) or context ids, not
    ``inserted_token_ids`` (ids added to close the previous turn, never trained on);
    ``removed_prefix_token_count`` counts ids dropped from the end of the previous running list
    (always 0 here, kept for verl's interface).
    """

    token_ids: list[int]
    appended_token_count: int
    kind: MergeKind = "context"
    inserted_token_ids: list[int] = field(default_factory=list)
    removed_prefix_token_count: int = 0


class ContinuousTokenBuilder:
    """Builds and grows the running token list of one conversation (text models).

    Args:
        tokenizer: HF tokenizer with a chat template.
        chat_template_kwargs: extra template variables (``data.apply_chat_template_kwargs``).
    """

    def __init__(
        self, tokenizer: Any, *, chat_template_kwargs: dict[str, Any] | None = None, **_: Any
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._end_ids = _end_of_turn_ids(tokenizer)

    @classmethod
    def supports_multimodal(cls) -> bool:
        """Images / videos are not rendered through a processor by this builder."""
        return False

    def build_initial_tokens(
        self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None, **_: Any
    ) -> list[int]:
        """The prompt: ``messages`` rendered with the generation prompt."""
        return apply_chat_template(
            self.tokenizer, messages, tools=tools, add_generation_prompt=True,
            **self.chat_template_kwargs,
        )

    def merge_assistant_tokens(
        self, runtime_token_ids: list[int], assistant_token_ids: list[int]
    ) -> MergeResult:
        """Append sampled ids exactly as the engine returned them."""
        return MergeResult(
            list(runtime_token_ids) + list(assistant_token_ids), len(assistant_token_ids),
            "assistant",
        )

    def merge_context_tokens(
        self, previous_messages: list[dict[str, Any]], updated_messages: list[dict[str, Any]],
        runtime_token_ids: list[int], *, tools: list[dict[str, Any]] | None = None,
    ) -> MergeResult:
        """Append the messages ``updated_messages`` has beyond ``previous_messages`` (tool / user
        turns)."""
        appended = _appended(previous_messages, updated_messages)
        if not appended:
            return MergeResult(list(runtime_token_ids), 0, "context")
        last = previous_messages[-1] if previous_messages else None
        after_assistant = bool(last and last.get("role") == "assistant")
        inserted: list[int] = []
        end_of_turn = None
        if after_assistant and runtime_token_ids:
            tail = int(runtime_token_ids[-1])
            if tail in self._end_ids:
                end_of_turn = self.tokenizer.convert_ids_to_tokens(tail)
            # the sampled turn was cut before its end-of-turn token: close it as the template would
            else:
                eos = self.tokenizer.eos_token_id
                inserted = [int(eos)] if eos is not None else []
        system = (
            updated_messages[0]
            if updated_messages and updated_messages[0].get("role") == "system"
            else None
        )
        ids = encode_new_turns(
            self.tokenizer, appended, system=system, tools=tools,
            previous=last if after_assistant else None, end_of_turn=end_of_turn,
            chat_template_kwargs=self.chat_template_kwargs,
        )
        # no assistant turn to close: drop the separator encode_new_turns put first
        if not after_assistant:
            ids = _without_separator(self.tokenizer, ids)
        return MergeResult(
            list(runtime_token_ids) + inserted + ids, len(ids), "context",
            inserted_token_ids=inserted,
        )

    # verl main renamed the context merge
    merge_non_assistant_tokens = merge_context_tokens

    @staticmethod
    def align_response_metadata(
        merge_result: MergeResult, response_mask: list[int],
        response_logprobs: list[float] | None = None, *,
        assistant_logprobs: list[float] | None = None,
    ) -> tuple[list[int], list[float] | None]:
        """Apply a merge to the response mask and log-probs: inserted and context ids get mask 0 /
        log-prob 0.0, sampled ids mask 1 and their log-probs."""
        mask = list(response_mask)
        logprobs = list(response_logprobs) if response_logprobs is not None else None
        if logprobs is None and assistant_logprobs is not None:
            raise ValueError(
                "align_response_metadata: pass response_logprobs ([] at first) "
                "with assistant_logprobs"
            )
        if merge_result.removed_prefix_token_count:
            mask = mask[: -merge_result.removed_prefix_token_count]
            logprobs = (
                logprobs[: -merge_result.removed_prefix_token_count]
                if logprobs is not None
                else None
            )
        n_new = len(merge_result.inserted_token_ids)
        mask += [0] * n_new
        if logprobs is not None:
            logprobs += [0.0] * n_new
        count = merge_result.appended_token_count
        if merge_result.kind == "assistant":
            mask += [1] * count
            if logprobs is not None:
                given = list(assistant_logprobs or [])
                if len(given) != count:
                    raise ValueError(
                        f"align_response_metadata: {len(given)} assistant "
                        f"log-probs for {count} "
                        "sampled ids; request logprobs from the engine for every turn"
                    )
                logprobs += given
        else:
            mask += [0] * count
            if logprobs is not None:
                logprobs += [0.0] * count
        return mask, logprobs


def _appended(
    previous: list[dict[str, Any]], updated: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    if len(updated) < len(previous) or list(updated[: len(previous)]) != list(previous):
        raise ValueError(
            "continuous tokens need append-only messages: updated_messages "
            "must start with "
            "previous_messages unchanged (edit the context with a new "
            "trajectory instead)"
        )
    appended = list(updated[len(previous):])
    bad = sorted({str(m.get("role")) for m in appended} - APPEND_ROLES)
    if bad:
        raise ValueError(f"continuous tokens cannot append messages with role(s) {bad}; "
                         f"allowed: {sorted(APPEND_ROLES)}")
    if appended and appended[-1].get("role") == "assistant":
        raise ValueError(
            "ct_merge_context_msg: the appended messages end with an assistant "
            "message; merge sampled "
            "ids with ct_merge_assistant_token instead"
        )
    return appended


def _end_of_turn_ids(tokenizer: Any) -> set[int]:
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    for token in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|call|>", "<|return|>", "<end_of_turn>"):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    return ids


def _without_separator(tokenizer: Any, ids: list[int]) -> list[int]:
    sep = turn_separator(tokenizer)
    if not sep:
        return ids
    sep_ids = list(tokenizer.encode(sep, add_special_tokens=False))
    return ids[len(sep_ids):] if ids[: len(sep_ids)] == sep_ids else ids
