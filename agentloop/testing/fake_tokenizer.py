"""A byte-level fake tokenizer for unit tests of agent loops (no model files, no transformers).

Token ids are UTF-8 bytes + 3; ids 0, 1, 2 are pad, ``<|im_start|>`` and ``<|im_end|>`` (eos).  The
chat template is ChatML-like: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message.
"""

from __future__ import annotations

import re
from typing import Any

PAD, IM_START, IM_END = 0, 1, 2
_SPECIAL = {PAD: "<|endoftext|>", IM_START: "<|im_start|>", IM_END: "<|im_end|>"}


class FakeTokenizer:
    """Deterministic, reversible, dependency-free stand-in for a HF tokenizer."""

    pad_token_id = PAD
    eos_token_id = IM_END
    eos_token = _SPECIAL[IM_END]
    pad_token = _SPECIAL[PAD]
    padding_side = "left"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Bytes + 3; the special token strings map to their ids."""
        pattern = "(" + "|".join(re.escape(s) for s in _SPECIAL.values()) + ")"
        ids: list[int] = []
        for part in re.split(pattern, text):
            special = next((k for k, v in _SPECIAL.items() if v == part), None)
            ids += [special] if special is not None else [b + 3 for b in part.encode("utf-8")]
        return ids

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        """Inverse of :meth:`encode`; special ids become their names unless skipped."""
        out: list[str] = []
        buf = bytearray()
        for t in list(ids):
            t = int(t)
            if t in _SPECIAL:
                out.append(buf.decode("utf-8", "replace"))
                buf = bytearray()
                if not skip_special_tokens:
                    out.append(_SPECIAL[t])
            else:
                buf.append((t - 3) % 256)
        out.append(buf.decode("utf-8", "replace"))
        return "".join(out)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tokenize: bool = True,
        add_generation_prompt: bool = False, return_dict: bool = False, **kwargs: Any,
    ) -> Any:
        """ChatML-like render; returns ids when ``tokenize`` (a dict when ``return_dict``)."""
        ids: list[int] = []
        for m in messages:
            ids += [
                IM_START, *self.encode(f"{m['role']}\n{m.get('content') or ''}"), IM_END,
                *self.encode("\n"),
            ]
        if add_generation_prompt:
            ids += [IM_START, *self.encode("assistant\n")]
        if not tokenize:
            return self.decode(ids)
        return {"input_ids": ids} if return_dict else ids
