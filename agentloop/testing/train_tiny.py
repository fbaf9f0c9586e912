"""Teach the tiny model to call the calculator tool (a few minutes on 2 CPU cores, deterministic).

Conversations are tokenized exactly as ``tool_agent`` builds a rollout, and the loss covers the
assistant turns only; :func:`evaluate_tool_use` measures call format, exact expressions and final
answers with greedy decoding on held-out problems.  Spec (what a step computes, why it is cheap, the
loss curve): docs/testing.md#training-the-tiny-model.
"""

from __future__ import annotations

import json
import math
import random
import time
from typing import Any

import torch
import torch.nn.functional as F

from agentloop.loops.prompt import apply_chat_template
from agentloop.parsers.hermes import HermesToolParser
from agentloop.testing.tiny_corpus import CALCULATOR_TOOL, IM_START, SYSTEM_PROMPTS, word_problem
from agentloop.tokenization import encode_new_turns

TOOLS = [CALCULATOR_TOOL]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def tool_call_text(expression: str) -> str:
    """The assistant's first turn, as the chat template renders a calculator call."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>\n{call}\n</tool_call>"


def make_example(
    tokenizer: Any, rng: random.Random, *, system_prompt: str | None = None
) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of one conversation; ``system_prompt`` defaults to a random one of the
    corpus."""
    question, expression, answer = word_problem(rng)
    system = {
        "role": "system",
        "content": rng.choice(SYSTEM_PROMPTS) if system_prompt is None else system_prompt,
    }
    prompt = apply_chat_template(
        tokenizer, [system, {"role": "user", "content": question}], tools=TOOLS,
        add_generation_prompt=True,
    )
    eos = tokenizer.eos_token_id
    call = _encode(tokenizer, tool_call_text(expression)) + [eos]
    tool = encode_new_turns(
        tokenizer, [{"role": "tool", "content": str(answer)}], system=system, tools=TOOLS
    )
    final = _encode(tokenizer, f"The answer is {answer}.") + [eos]
    ids = prompt + call + tool + final
    mask = [0] * len(prompt) + [1] * len(call) + [0] * len(tool) + [1] * len(final)
    return ids, mask


class ExampleMaker:
    """:func:`make_example` for a batch sharing one system prompt, about 4 times faster.

    The chat template renders once per system prompt; the questions are spliced into the rendered
    text and only the part after the system block is tokenized, in one batch call; the tool result's
    digits are spliced into the tool turn's ids.  The ids are :func:`make_example`'s (a unit test
    checks it): the tokenizer splits at special tokens before anything else, the template copies the
    question verbatim, and every digit is a token of its own.
    """

    _MARK = "\x00question\x00"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
        self._pieces: dict[str, tuple[list[int], str, str, list[int], list[int]]] = {}

    def _system_pieces(
        self, system_prompt: str
    ) -> tuple[list[int], str, str, list[int], list[int]]:
        """Ids up to the user turn's ``<|im_start|>``; the prompt text after them, before and after
        the question; the tool turn's ids before and after the result."""
        if system_prompt not in self._pieces:
            tok = self.tokenizer
            system = {"role": "system", "content": system_prompt}
            text = tok.apply_chat_template(
                [system, {"role": "user", "content": self._MARK}], tools=TOOLS,
                add_generation_prompt=True, tokenize=False,
            )
            head, tail = text.split(self._MARK)
            split = head.rindex(IM_START) + len(IM_START)
            tool = encode_new_turns(
                tok, [{"role": "tool", "content": "0"}], system=system, tools=TOOLS
            )
            cut = tool.index(self.digits[0])
            self._pieces[system_prompt] = (
                _encode(tok, head[:split]), head[split:], tail, tool[:cut], tool[cut + 1 :],
            )
        return self._pieces[system_prompt]

    def examples(
        self, rng: random.Random, size: int, system_prompt: str
    ) -> list[tuple[list[int], list[int]]]:
        """What ``size`` calls of ``make_example(tokenizer, rng, system_prompt=system_prompt)``
        return."""
        head_ids, user, tail, tool_head, tool_tail = self._system_pieces(system_prompt)
        problems = [word_problem(rng) for _ in range(size)]
        texts = [user + question + tail for question, _, _ in problems]
        texts += [tool_call_text(expression) for _, expression, _ in problems]
        texts += [f"The answer is {answer}." for _, _, answer in problems]
        encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        eos, out = self.tokenizer.eos_token_id, []
        for i, (_, _, answer) in enumerate(problems):
            prompt, call, final = (
                head_ids + encoded[i], [*encoded[size + i], eos], [*encoded[2 * size + i], eos],
            )
            # answers are >= 0
            tool = tool_head + [self.digits[int(d)] for d in str(answer)] + tool_tail
            mask = [0] * len(prompt) + [1] * len(call) + [0] * len(tool) + [1] * len(final)
            out.append((prompt + call + tool + final, mask))
        return out


def prefix_batch(
    maker: ExampleMaker, rng: random.Random, size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One system prompt, ``size`` conversations: (shared prefix [P], suffixes [B, S], loss mask [B,
    S]).

    Suffixes are right-padded; ``mask[b, j]`` says whether predicting ``suffix[b, j]`` counts.  The
    prefix is what all conversations share, loss-free, less one token: the first suffix token,
    predicted from the prefix, must carry no loss either (logits are computed from suffix positions
    only).
    """
    examples = maker.examples(rng, size, rng.choice(SYSTEM_PROMPTS))
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((size, width), maker.tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((size, width), dtype=torch.bool)
    for i, (x, m) in enumerate(examples):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = torch.tensor(m, dtype=torch.bool)
    shared = (ids == ids[:1]).all(0) & ~mask.any(0)
    cut = int((~shared).nonzero()[0]) - 1
    return ids[0, :cut], ids[:, cut:], mask[:, cut:]


def batch_loss(
    model: Any, prefix: torch.Tensor, suffix: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Mean next-token loss of the sequences ``prefix + suffix[b]`` over the suffix positions in
    ``mask``.

    Equal to the loss of the full batched forward pass: the prefix runs once and its KV cache is
    repeated over the batch.  No attention mask is needed for the right padding: causal attention
    keeps every real token from seeing the padding after it.
    """
    cache = model.model(input_ids=prefix[None], use_cache=True).past_key_values
    cache.batch_repeat_interleave(suffix.shape[0])
    hidden = model.model(input_ids=suffix, past_key_values=cache, use_cache=True).last_hidden_state
    keep = mask[:, 1:]
    logits = model.lm_head(hidden[:, :-1][keep])
    return F.cross_entropy(logits.float(), suffix[:, 1:][keep])


def train_tool_use(
    model: Any, tokenizer: Any, *, steps: int, batch_size: int = 64, lr: float = 3e-3,
    seed: int = 0, stop_after: int | None = None,
) -> dict[str, float]:
    """Train in place with AdamW and a warm-up + cosine schedule; returns timing and final loss.

    ``stop_after`` ends training after that many steps of the ``steps``-step schedule (a snapshot of
    the same run: the first ``stop_after`` steps are exactly those of the full run).  Without it all
    ``steps`` run.
    """
    if stop_after is not None and not 0 < stop_after <= steps:
        raise ValueError(f"stop_after must be in 1..steps={steps}, got {stop_after}")
    torch.manual_seed(seed)
    rng = random.Random(seed + 1)
    maker = ExampleMaker(tokenizer)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
        ),
    )
    start, loss_value = time.perf_counter(), float("nan")
    run = steps if stop_after is None else stop_after
    for _ in range(run):
        loss = batch_loss(model, *prefix_batch(maker, rng, batch_size))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss_value = float(loss.detach())
    model.eval()
    return {"steps": run, "seconds": time.perf_counter() - start, "final_loss": loss_value}


@torch.no_grad()
def _greedy(model: Any, tokenizer: Any, prompt: list[int], max_new: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new, do_sample=False, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return out[0, len(prompt):].tolist()


def evaluate_tool_use(
    model: Any, tokenizer: Any, n: int = 50, seed: int = 12345
) -> dict[str, float]:
    """Greedy rates on ``n`` held-out problems: well-formed call, exact expression, right final
    answer given the true tool result, and ``end_to_end`` (exact expression and then the right
    answer)."""
    rng = random.Random(seed)
    parser = HermesToolParser(tokenizer)
    formed = exact = right = both = 0
    for _ in range(n):
        question, expression, answer = word_problem(rng)
        system = {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}
        messages = [system, {"role": "user", "content": question}]
        prompt = apply_chat_template(tokenizer, messages, tools=TOOLS, add_generation_prompt=True)
        first = _greedy(model, tokenizer, prompt, 48)
        _, calls = parser.parse_text(tokenizer.decode(first, skip_special_tokens=True), TOOLS)
        ok = len(calls) == 1 and calls[0].error is None
        is_exact = ok and json.loads(calls[0].arguments).get("expression") == expression
        context = prompt + _encode(tokenizer, tool_call_text(expression)) + [tokenizer.eos_token_id]
        context += encode_new_turns(
            tokenizer, [{"role": "tool", "content": str(answer)}], system=system, tools=TOOLS
        )
        final = tokenizer.decode(_greedy(model, tokenizer, context, 16), skip_special_tokens=True)
        is_right = final.strip() == f"The answer is {answer}."
        formed, exact, right, both = (
            formed + ok, exact + is_exact, right + is_right, both + (is_exact and is_right),
        )
    return {
        "well_formed_call": formed / n, "exact_expression": exact / n,
        "right_answer_given_result": right / n, "end_to_end": both / n,
    }
