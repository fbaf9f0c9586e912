"""reasoning-gym tasks: its procedural datasets as rollout rows, its scorers as the reward
(docs/environments.md#reasoning-gym).

* :func:`make_rows` / :func:`write_rows` (and ``python -m agentloop.envs.reasoning_gym``): rows
  in verl's dataset format from ``reasoning_gym.create_dataset(name, size=, seed=, **config)``,
  reproducible by seed, nothing downloaded. Each row keeps the recipe of its entry in
  ``extra_info["reasoning_gym"]`` (``{"dataset", "seed", "size", "config", "index", "entry"}``).
* :func:`compute_score`: a ``custom_reward_function`` that re-creates the row's entry from that
  recipe (:func:`entry_of`) and returns the dataset's own ``score_answer(answer, entry)``, the
  answer being the text of the last ``<answer>...</answer>`` (reasoning-gym's ``extract_answer``).
* :class:`ReasoningGymEnv`, registered as ``reasoning_gym``: the same scoring as a one-step
  environment of the ``env_agent`` loop.

Needs the ``reasoning-gym`` package (``pip install 'agentloop[envs]'``).
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agentloop.envs.base import ENVS, AssistantTurn, EnvReset, EnvStep
from agentloop.errors import ConfigError, DatasetError
from agentloop.utils.registry import did_you_mean

__all__ = [
    "ReasoningGymEnv", "compute_score", "entry_of", "make_rows", "score", "write_rows",
]

INSTALL = "pip install 'agentloop[envs]' (or pip install reasoning-gym)"
"""How to get the package, for the missing-package error."""

RECIPE_KEY = "reasoning_gym"
"""``extra_info`` key holding a row's recipe: ``{"dataset", "seed", "size", "config", "index",
"entry"}`` (``config`` and ``entry``: JSON text, so parquet keeps them whatever their fields)."""

DATA_SOURCE = "reasoning_gym/{dataset}"
"""A row's ``data_source``."""


def _rg() -> Any:
    """The ``reasoning_gym`` module.

    Raises:
        ConfigError: the package is not installed (the message names the install command).
    """
    try:
        import reasoning_gym  # optional dependency: the envs extra (slow to import, ~1 s)
    except ImportError as e:
        raise ConfigError(
            f"reasoning-gym tasks need the reasoning-gym package, which is not installed ({e}); "
            f"install it: {INSTALL}"
        ) from e
    return reasoning_gym


def _check_name(dataset: str) -> None:
    """Raises ConfigError when ``dataset`` is not one of reasoning-gym's task names."""
    known = sorted(_rg().factory.DATASETS)
    if dataset not in known:
        raise ConfigError(
            f"reasoning-gym has no dataset {dataset!r}; {did_you_mean(dataset, known)}"
            f"known: {known}"
        )


@functools.lru_cache(maxsize=64)
def _dataset(dataset: str, seed: int, size: int, config_json: str) -> Any:
    """``create_dataset(dataset, size=, seed=, **config)``, cached by its recipe."""
    _check_name(dataset)
    config = json.loads(config_json)
    try:
        return _rg().create_dataset(dataset, size=size, seed=seed, **config)
    except (TypeError, ValueError, AssertionError) as e:
        raise ConfigError(
            f"reasoning-gym dataset {dataset!r} refused its config {config} "
            f"({type(e).__name__}: {e}); see the dataset's config class for its fields"
        ) from e


def _config_json(config: Mapping[str, Any] | str | None) -> str:
    """A dataset config (a mapping, or its JSON text as a recipe keeps it) as sorted JSON."""
    if isinstance(config, str):
        return json.dumps(json.loads(config or "{}"), sort_keys=True)
    return json.dumps(dict(config or {}), sort_keys=True)


def system_prompt(name_or_text: str | None) -> str | None:
    """reasoning-gym's system prompt ``name_or_text`` (``default``, ``DeepSeekZero``, ``simple``,
    ``direct``, ``chain_of_draft``), or the text itself when it is no such name; None: none."""
    if name_or_text is None:
        return None
    prompts = _rg().utils.SYSTEM_PROMPTS
    return str(prompts.get(name_or_text, name_or_text))


def make_rows(dataset: str, size: int, seed: int, config: Mapping[str, Any] | None = None,
              system: str | None = "default", row_fields: Mapping[str, Any] | None = None,
              ) -> list[dict[str, Any]]:
    """``size`` rollout rows of reasoning-gym task ``dataset`` (verl's dataset format).

    Args:
        dataset: a reasoning-gym task name (``leg_counting``, ``basic_arithmetic``, ...).
        size: how many rows; seed: the dataset's seed (the same seed gives the same rows).
        config: the dataset's own config fields (e.g. ``{"min_animals": 2}``).
        system: a system prompt name of reasoning-gym or its text (None: no system message).
        row_fields: fields added to every row (e.g. ``{"agent_name": "env_agent"}``); a nested
            ``extra_info`` is merged into each row's.
    Returns:
        Rows with ``prompt`` (system + the question), ``data_source`` (``reasoning_gym/<name>``),
        ``reward_model.ground_truth`` (the oracle answer) and ``extra_info`` (``index``, the
        entry's recipe under ``reasoning_gym``).
    Raises:
        ConfigError: unknown task name, a config the dataset refuses, or the package is missing.
    """
    config_json = _config_json(config)
    data = _dataset(dataset, int(seed), int(size), config_json)
    text = system_prompt(system)
    extra = dict(row_fields or {})
    extra_info = dict(extra.pop("extra_info", None) or {})
    rows = []
    for i in range(int(size)):
        entry = data[i]
        recipe = {"dataset": dataset, "seed": int(seed), "size": int(size),
                  "config": config_json, "index": i, "entry": _entry_json(entry)}
        prompt = [{"role": "system", "content": text}] if text is not None else []
        prompt.append({"role": "user", "content": str(entry["question"])})
        rows.append({
            "data_source": DATA_SOURCE.format(dataset=dataset),
            "prompt": prompt,
            "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
            "extra_info": {**extra_info, "index": i, RECIPE_KEY: recipe},
            **extra,
        })
    return rows


def write_rows(path: str | Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    """Write ``rows`` to ``path``: JSONL for ``.jsonl``, parquet (pandas) for ``.parquet``.

    Raises:
        DatasetError: another extension.
    """
    out = Path(path).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".jsonl":
        out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                       encoding="utf-8")
    elif out.suffix == ".parquet":
        import pandas as pd  # heavy (~0.5 s): only for parquet output

        pd.DataFrame(list(rows)).to_parquet(out)
    else:
        raise DatasetError(f"{out}: write .jsonl or .parquet, not {out.suffix!r}")
    return out


def _entry_json(entry: Mapping[str, Any]) -> str | None:
    """An entry as sorted JSON text (None when it holds a value JSON cannot write)."""
    try:
        return json.dumps(entry, sort_keys=True)
    except (TypeError, ValueError):
        return None


def entry_of(recipe: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The dataset and the entry a row's recipe names (``extra_info["reasoning_gym"]``).

    The entry is regenerated from the recipe (its exact Python values, tuples included); when the
    recipe's stored ``entry`` JSON differs from it (a generator that depends on the process's hash
    seed, docs/environments.md#reasoning-gym), the stored entry is the row's and is used.

    Raises:
        ValueError: the recipe lacks a field or names an index past the dataset's size.
        ConfigError: unknown task, refused config, or the package is missing.
    """
    try:
        dataset, seed, size = str(recipe["dataset"]), int(recipe["seed"]), int(recipe["size"])
        index = int(recipe["index"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"extra_info.{RECIPE_KEY} must hold dataset, seed, size and index (as make_rows writes "
            f"them); got {dict(recipe)!r}"
        ) from e
    if not 0 <= index < size:
        raise ValueError(f"extra_info.{RECIPE_KEY}: index {index} is outside size {size}")
    data = _dataset(dataset, seed, size, _config_json(recipe.get("config")))
    entry = data[index]
    stored = recipe.get("entry")
    if isinstance(stored, str) and _entry_json(entry) != stored:
        return data, json.loads(stored)
    return data, entry


def _recipe(extra_info: Mapping[str, Any] | None) -> Mapping[str, Any]:
    recipe = (extra_info or {}).get(RECIPE_KEY)
    if not isinstance(recipe, Mapping):
        raise ValueError(
            f"no extra_info.{RECIPE_KEY} in this row: reasoning-gym scoring needs rows made by "
            "agentloop.envs.reasoning_gym.make_rows (python -m agentloop.envs.reasoning_gym)"
        )
    return recipe


def score(solution_str: str, recipe: Mapping[str, Any], ground_truth: Any = None,
          answer_tag: str | None = "answer") -> float:
    """The dataset's ``score_answer`` of the answer in ``solution_str`` for the recipe's entry.

    Args:
        solution_str: the response text.
        recipe: the row's ``extra_info["reasoning_gym"]``.
        ground_truth: the row's; when given it must equal the regenerated entry's answer.
        answer_tag: the answer is the last ``<tag>...</tag>`` (reasoning-gym's ``extract_answer``;
            None: if there is none); None or "": the whole response is the answer.
    Raises:
        ValueError: a bad recipe, or an entry whose answer differs from ``ground_truth`` (another
            reasoning-gym version made the rows).
    """
    data, entry = entry_of(recipe)
    if ground_truth is not None and str(ground_truth) != str(entry["answer"]):
        raise ValueError(
            f"reasoning-gym {recipe['dataset']} row {recipe['index']}: the regenerated entry's "
            f"answer {str(entry['answer'])[:60]!r} differs from the row's ground_truth "
            f"{str(ground_truth)[:60]!r}; regenerate the rows with this reasoning-gym version"
        )
    answer: str | None = solution_str
    if answer_tag:
        answer = _rg().utils.extract_answer(solution_str, tag_name=answer_tag)
    return float(data.score_answer(answer, entry))


def compute_score(data_source: Any, solution_str: str, ground_truth: Any,
                  extra_info: Mapping[str, Any] | None = None, *,
                  answer_tag: str | None = "answer", **kwargs: Any) -> float:
    """verl's ``custom_reward_function`` signature: :func:`score` of the row's entry.

    Use it as ``custom_reward_function: {path: agentloop.envs.reasoning_gym, name:
    compute_score}``; ``reward_kwargs: {answer_tag: null}`` scores the whole response.

    Raises:
        ValueError: the row was not made by :func:`make_rows` (no recipe) or another version made
            it (the row then gets ``reward_error``).
    """
    return score(solution_str, _recipe(extra_info), ground_truth, answer_tag)


class ReasoningGymEnv:
    """A one-step environment: the row's prompt, then the dataset's score of the one answer.

    Registered as ``reasoning_gym`` (by import path, so ``python -m`` of this module registers
    the same object).

    Args:
        answer_tag: as for :func:`score`.
    Raises:
        ConfigError: reasoning-gym is not installed.
    """

    def __init__(self, answer_tag: str | None = "answer") -> None:
        _rg()
        self.answer_tag = answer_tag
        self.recipe: Mapping[str, Any] = {}
        self.ground_truth: Any = None

    def reset(self, sample: dict[str, Any]) -> EnvReset:
        """The sample's ``raw_prompt``; its recipe (``extra_info.reasoning_gym``) is kept.

        Raises:
            ValueError: no ``raw_prompt``, or no recipe in ``extra_info``.
        """
        prompt = sample.get("raw_prompt")
        if prompt is None:
            raise ValueError("reasoning_gym: the sample has no raw_prompt")
        self.recipe = _recipe(sample.get("extra_info"))
        reward_model = sample.get("reward_model")
        if isinstance(reward_model, Mapping):
            self.ground_truth = reward_model.get("ground_truth")
        return EnvReset(messages=[dict(m) for m in prompt],
                        info={"rg_dataset": str(self.recipe.get("dataset"))})

    def step(self, turn: AssistantTurn) -> EnvStep:
        """Done after one turn, rewarded with :func:`score` of ``turn.text``."""
        value = score(turn.text, self.recipe, self.ground_truth, self.answer_tag)
        return EnvStep(messages=[], reward=value, done=True)

    def close(self) -> None:
        """Nothing to release."""

    @classmethod
    def check_config(cls, config: Mapping[str, Any]) -> None:
        """The start-up check (before any engine): reasoning-gym is installed.

        Raises:
            ConfigError: it is not (the message names the install command).
        """
        _rg()


ENVS.add("reasoning_gym", "agentloop.envs.reasoning_gym.ReasoningGymEnv")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m agentloop.envs.reasoning_gym DATASET --size N --seed S -o rows.jsonl``."""
    parser = argparse.ArgumentParser(
        prog="python -m agentloop.envs.reasoning_gym",
        description="Write rollout rows of a reasoning-gym task (JSONL or parquet).")
    parser.add_argument("dataset", help="reasoning-gym task name, e.g. leg_counting")
    parser.add_argument("--size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", default="{}", help="the dataset's config as JSON")
    parser.add_argument("--system", default="default",
                        help="reasoning-gym system prompt name or text ('' for none)")
    parser.add_argument("--row-fields", default="{}",
                        help='JSON fields added to each row, e.g. {"agent_name": "env_agent"}')
    parser.add_argument("-o", "--output", required=True, help="a .jsonl or .parquet path")
    args = parser.parse_args(argv)
    rows = make_rows(args.dataset, args.size, args.seed, json.loads(args.config),
                     args.system or None, json.loads(args.row_fields))
    print(f"wrote {len(rows)} rows to {write_rows(args.output, rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
