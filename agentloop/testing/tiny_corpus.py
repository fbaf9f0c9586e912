"""The tiny model's chat format and synthetic data: ChatML tokens, the calculator tool, the chat
template, word problems and the tokenizer corpus.

Shared by the builder (:mod:`agentloop.testing.tiny_model`, which re-exports these names) and the
trainer (:mod:`agentloop.testing.train_tiny`), so neither imports the other's module for them.
"""

from __future__ import annotations

import json
import random
from typing import Any

from agentloop.tools.calculator import CALCULATOR_TOOL_DICT

PAD_TOKEN, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
CALCULATOR_TOOL: dict[str, Any] = CALCULATOR_TOOL_DICT  # the schema the model is trained to call
TOOLS_HEADER = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n"
    "</tool_call>"
)

# ChatML + hermes tools, as Qwen2.5 renders them (without Qwen's default system prompt when no
# tools).
CHAT_TEMPLATE = (
    r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages and messages[0].role == 'system' %}{{- messages[0].content }}
    {%- else %}{{- '"""
    + DEFAULT_SYSTEM_PROMPT
    + r"""' }}{%- endif %}
    {{- '"""
    + TOOLS_HEADER.replace("\n", r"\n")
    + r"""' }}
    {%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '"""
    + TOOLS_FOOTER.replace("\n", r"\n")
    + r"""<|im_end|>\n' }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' ~ messages[0].content ~ '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}{{- '<|im_start|>system\n' ~ message.content ~ '<|im_end|>\n' }}{%- endif %}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\n' ~ message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' ~ tool_call.name ~ '", "arguments": ' }}
            {%- if tool_call.arguments is string %}{{- tool_call.arguments }}
            {%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' ~ (message.content or '') ~ '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- elif message.role is defined and message.role %}
        {{- '<|im_start|>' ~ message.role ~ '\n' ~ (message.content or '') ~ '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""
)

_NAMES = (
    "Ann", "Bob", "Cleo", "Dev", "Eve", "Finn", "Gus", "Hana", "Ivan", "Jade", "Kai", "Lena",
    "Milo", "Nora", "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera",
)
_THINGS = (
    "apples", "books", "coins", "marbles", "stamps", "cookies", "pencils", "shells", "stickers",
    "cards", "eggs", "oranges", "bottles", "candles", "flowers", "tickets", "boxes", "chairs",
    "plates", "cups", "shirts", "socks", "bricks", "stones", "buttons", "beads", "balloons",
    "kites", "toys", "seeds",
)
_PLACES = (
    "school", "the park", "the market", "the library", "the farm", "the shop", "the beach",
    "the garden", "the museum", "home",
)
_WORDS = (
    "the", "a", "an", "and", "or", "but", "if", "then", "when", "while", "because", "so", "that",
    "this", "there", "here", "what", "which", "who", "how", "why", "is", "are", "was", "were", "be",
    "been", "has", "have", "had", "do", "does", "did", "can", "could", "will", "would", "should",
    "not", "no", "yes", "all", "each", "every", "some", "many", "more", "most", "few", "less",
    "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "hundred",
    "thousand", "number", "total", "sum", "difference", "product", "result", "answer", "question",
    "problem", "step", "first", "next", "last", "before", "after", "again", "also", "only", "just",
    "very", "always", "never", "today", "day", "week", "year", "time", "people", "friend", "family",
    "teacher", "student", "water", "food", "money", "price", "cost", "buy", "bought", "sell",
    "sold", "give", "gave", "take", "took", "get", "got", "make", "made", "find", "found", "keep",
    "left", "right", "big", "small", "new", "old", "good", "same", "different", "add", "subtract",
    "multiply", "plus", "minus", "times", "equals", "count", "calculate", "compute", "check",
    "tool", "function", "call", "use", "help", "helpful", "assistant", "user", "system", "reply",
    "please", "thanks", "you", "your", "my", "our", "their", "his", "her", "we", "they", "he",
    "she", "it", "them", "think", "know", "want", "need", "like", "see", "look", "read", "write",
    "said", "say", "tell", "ask", "show", "try", "work",
)
_PROBLEMS = (
    ("+", "{who} has {a} {thing} and finds {b} more. How many {thing} does {who} have now?"),
    (
        "+",
        "There are {a} {thing} in one box and {b} {thing} in another. How many {thing} "
        "are there in all?",
    ),
    ("+", "{who} bought {a} {thing} at {place} and then {b} more. How many {thing} did {who} buy?"),
    ("+", "What is {a} plus {b}?"),
    ("-", "{who} had {a} {thing} and gave {b} of them to {other}. How many {thing} are left?"),
    ("-", "A shop had {a} {thing} and sold {b}. How many {thing} does the shop have now?"),
    (
        "-",
        "{who} collected {a} {thing} at {place} but lost {b} on the way home. How many are left?",
    ),
    ("-", "What is {a} minus {b}?"),
    ("*", "{who} has {a} bags with {b} {thing} in each bag. How many {thing} does {who} have?"),
    (
        "*",
        "Each of {a} students brings {b} {thing} to {place}. How many {thing} are there in total?",
    ),
    ("*", "A crate holds {b} {thing}. How many {thing} are in {a} crates?"),
    ("*", "What is {a} times {b}?"),
    ("+", "Calculate {a} + {b}."),
    ("-", "Calculate {a} - {b}."),
    ("*", "Calculate {a} * {b}."),
)
_ONSETS = (
    "b", "bl", "br", "c", "ch", "cl", "cr", "d", "dr", "f", "fl", "fr", "g", "gr", "h", "j", "k",
    "l", "m", "n", "p", "pl", "pr", "r", "s", "sh", "sl", "sp", "st", "t", "th", "tr", "v", "w",
    "y", "z",
)
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou")
_CODAS = ("", "", "", "n", "nd", "ng", "r", "s", "st", "t", "ck", "ll", "m", "sh", "th", "ve")
SYSTEM_PROMPTS = (
    DEFAULT_SYSTEM_PROMPT,
    "You are a careful math assistant. Use the calculator tool for arithmetic, then give "
    "the answer.",
    "You solve word problems step by step. Always check the result with a tool call.",
)


def calculate(a: int, op: str, b: int) -> int:
    """``a op b`` for the three operators of the synthetic corpus."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b


def word_problem(rng: random.Random) -> tuple[str, str, int]:
    """A random word problem: ``(question, expression, answer)``; numbers 0-999."""
    op, text = rng.choice(_PROBLEMS)
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    if op == "-" and b > a:
        a, b = b, a
    who, other = rng.sample(_NAMES, 2)
    fields = {
        "who": who, "other": other, "thing": rng.choice(_THINGS), "place": rng.choice(_PLACES),
    }
    return text.format(a=a, b=b, **fields), f"{a} {op} {b}", calculate(a, op, b)


def word_problem_rows(
    n: int, *, agent_name: str, data_source: str, seed: int = 0
) -> list[dict[str, Any]]:
    """``n`` word problems as dataset rows in verl's format (system + user prompt, ``agent_name``,
    ``reward_model.ground_truth``, ``extra_info.{index, expression}``), for examples and benchmarks.
    """
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        question, expression, answer = word_problem(rng)
        rows.append(
            {
                "data_source": data_source,
                "prompt": [
                    {"role": "system", "content": SYSTEM_PROMPTS[1]},
                    {"role": "user", "content": question},
                ],
                "agent_name": agent_name,
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"index": i, "expression": expression},
            }
        )
    return rows


def _tool_system_text(system: str) -> str:
    return (
        system
        + TOOLS_HEADER
        + "\n"
        + json.dumps(CALCULATOR_TOOL, ensure_ascii=False)
        + TOOLS_FOOTER
    )


def _conversation(rng: random.Random) -> str:
    """One tool-use conversation as plain text (the ChatML special tokens are left out)."""
    question, expression, answer = word_problem(rng)
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    turns = [f"system\n{_tool_system_text(rng.choice(SYSTEM_PROMPTS))}", f"user\n{question}"]
    turns += [
        f"assistant\n<tool_call>\n{call}\n</tool_call>",
        f"user\n<tool_response>\n{answer}\n</tool_response>",
    ]
    return "\n".join([*turns, f"assistant\nThe answer is {answer}."])


def _lexicon(rng: random.Random, size: int = 1500) -> list[str]:
    """English-sounding made-up words (1-3 syllables), so the BPE vocabulary fills up with
    plausible pieces."""
    words: set[str] = set()
    while len(words) < size:
        syllables = [
            rng.choice(_ONSETS) + rng.choice(_NUCLEI) for _ in range(rng.choice((1, 1, 2, 2, 3)))
        ]
        words.add("".join(syllables) + rng.choice(_CODAS))
    return sorted(words)


def _chatter(rng: random.Random, lexicon: list[str]) -> str:
    """A sentence of English-ish filler: common words with some made-up ones (Zipf-like
    frequencies)."""
    vocab = _WORDS + _THINGS + _NAMES
    words = [
        rng.choice(vocab) if rng.random() < 0.7 else _zipf_choice(rng, lexicon)
        for _ in range(rng.randint(6, 16))
    ]
    sentence = " ".join(words)
    return sentence[0].upper() + sentence[1:] + rng.choice([".", "?", "!", ","])


def _zipf_choice(rng: random.Random, items: list[str]) -> str:
    return items[min(int(len(items) ** rng.random()) - 1, len(items) - 1)]


def synthetic_corpus(
    n_conversations: int = 2000, n_sentences: int = 6000, seed: int = 0
) -> list[str]:
    """The deterministic tokenizer training corpus."""
    rng = random.Random(seed)
    docs = [_conversation(rng) for _ in range(n_conversations)]
    lexicon = _lexicon(rng)
    rng.shuffle(lexicon)
    docs += [_chatter(rng, lexicon) for _ in range(n_sentences)]
    docs += [" ".join(sorted(set(_WORDS + _THINGS + _NAMES + _PLACES)))]
    return docs
