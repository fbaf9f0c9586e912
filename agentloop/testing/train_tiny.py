"""Teach the tiny model to call the calculator tool (a few minutes on 2 CPU cores, deterministic).

Each training conversation is tokenized exactly as ``tool_agent`` builds a rollout: the prompt (system +
tools block + word problem, generation prompt appended), the assistant's hermes tool call + ``<|im_end|>``,
the tool turn from :func:`agentloop.tokenization.encode_new_turns`, and the final "The answer is N." +
``<|im_end|>``.  The loss covers the two assistant turns only.  :func:`evaluate_tool_use` measures, with
greedy decoding on held-out problems, how often the first turn is a well-formed calculator call, how
often its expression is exact, and how often the final answer is right given the true tool result.
"""

from __future__ import annotations

import json
import math
import random
import time
from typing import Any

import torch

from agentloop.loops.prompt import apply_chat_template
from agentloop.parsers.hermes import HermesToolParser
from agentloop.testing.tiny_model import _SYSTEM_PROMPTS, CALCULATOR_TOOL, word_problem
from agentloop.tokenization import encode_new_turns

TOOLS = [CALCULATOR_TOOL]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def tool_call_text(expression: str) -> str:
    """The assistant's first turn, as the chat template renders a calculator call."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>\n{call}\n</tool_call>"


def make_example(tokenizer: Any, rng: random.Random) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of one conversation."""
    question, expression, answer = word_problem(rng)
    system = {"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)}
    prompt = apply_chat_template(tokenizer, [system, {"role": "user", "content": question}], tools=TOOLS,
                                 add_generation_prompt=True)
    eos = tokenizer.eos_token_id
    call = _encode(tokenizer, tool_call_text(expression)) + [eos]
    tool = encode_new_turns(tokenizer, [{"role": "tool", "content": str(answer)}], system=system, tools=TOOLS)
    final = _encode(tokenizer, f"The answer is {answer}.") + [eos]
    ids = prompt + call + tool + final
    mask = [0] * len(prompt) + [1] * len(call) + [0] * len(tool) + [1] * len(final)
    return ids, mask


def _batch(tokenizer: Any, rng: random.Random, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    examples = [make_example(tokenizer, rng) for _ in range(size)]
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((size, width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((size, width), -100, dtype=torch.long)
    attn = torch.zeros((size, width), dtype=torch.long)
    for i, (x, m) in enumerate(examples):
        ids[i, : len(x)] = torch.tensor(x)
        attn[i, : len(x)] = 1
        labels[i, : len(x)] = torch.where(torch.tensor(m, dtype=torch.bool), torch.tensor(x), -100)
    return ids, attn, labels


def train_tool_use(
    model: Any, tokenizer: Any, *, steps: int, batch_size: int = 32, lr: float = 3e-3, seed: int = 0
) -> dict[str, float]:
    """Train in place with AdamW and a warm-up + cosine schedule; returns timing and final loss."""
    torch.manual_seed(seed)
    rng = random.Random(seed + 1)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    start, loss_value = time.perf_counter(), float("nan")
    for _ in range(steps):
        ids, attn, labels = _batch(tokenizer, rng, batch_size)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss_value = float(loss.detach())
    model.eval()
    return {"steps": steps, "seconds": time.perf_counter() - start, "final_loss": loss_value}


@torch.no_grad()
def _greedy(model: Any, tokenizer: Any, prompt: list[int], max_new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return out[0, len(prompt):].tolist()


def evaluate_tool_use(model: Any, tokenizer: Any, n: int = 50, seed: int = 12345) -> dict[str, float]:
    """Greedy rates on ``n`` held-out problems: well-formed call, exact expression, right final answer."""
    rng = random.Random(seed)
    parser = HermesToolParser(tokenizer)
    formed = exact = right = 0
    for _ in range(n):
        question, expression, answer = word_problem(rng)
        system = {"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)}
        messages = [system, {"role": "user", "content": question}]
        prompt = apply_chat_template(tokenizer, messages, tools=TOOLS, add_generation_prompt=True)
        first = _greedy(model, tokenizer, prompt, 48)
        _, calls = parser.parse_text(tokenizer.decode(first, skip_special_tokens=True), TOOLS)
        ok = len(calls) == 1 and calls[0].error is None
        formed += ok
        exact += ok and json.loads(calls[0].arguments).get("expression") == expression
        context = prompt + _encode(tokenizer, tool_call_text(expression)) + [tokenizer.eos_token_id]
        context += encode_new_turns(tokenizer, [{"role": "tool", "content": str(answer)}], system=system, tools=TOOLS)
        final = tokenizer.decode(_greedy(model, tokenizer, context, 16), skip_special_tokens=True)
        right += final.strip() == f"The answer is {answer}."
    return {"well_formed_call": formed / n, "exact_expression": exact / n, "right_answer_given_result": right / n}
