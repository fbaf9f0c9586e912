"""verl's ``verl.utils.rollout_trace`` on agentloop's recorder (:mod:`agentloop.trace`).

``@rollout_trace_op`` records a method's calls as spans (inputs, outputs or exception) while tracing
is on; ``rollout_trace_attr(...)`` attaches a sample's attributes to the spans recorded inside it
and records the block as their parent span; ``RolloutTraceConfig.init(...)`` configures the process
once, with backend None, ``"jsonl"`` or ``"mlflow"`` (verl's ``weave`` / ``trackio``, a negative
sample limit, or mlflow without MLflow installed raise a ConfigError). Spec:
docs/tracing.md#verls-api-agentloopcompatrollout_trace.
"""

from __future__ import annotations

import functools
import inspect
import os
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel

from agentloop.compat.import_map import MissingVerlNameError, missing_verl_name
from agentloop.errors import ConfigError
from agentloop.trace import configure, enabled, span, suppressed, trace_attributes

__all__ = ["RolloutTraceConfig", "rollout_trace_attr", "rollout_trace_op", "select_traced_rows"]

F = TypeVar("F", bound=Callable[..., Any])
SUPPORTED_BACKENDS = (None, "jsonl", "mlflow")
VERL_ONLY_BACKENDS = ("weave", "trackio")
TRACE_PATH_ENV = "AGENTLOOP_TRACE_PATH"


class RolloutTraceConfig:
    """verl's process-wide trace settings, mapped onto :func:`agentloop.trace.configure`.

    ``init`` configures once per process (later calls are ignored, as in verl) and ``reset`` turns
    tracing off again.  Attributes mirror verl's: ``backend``, ``client`` (always None here),
    ``token2text``, ``project_name``, ``experiment_name``, ``max_samples_per_step_per_worker``;
    ``path`` is the JSONL file.
    """

    _instance: ClassVar[RolloutTraceConfig | None] = None
    backend: str | None = None
    client: object | None = None
    token2text: bool = False
    project_name: str | None = None
    experiment_name: str | None = None
    max_samples_per_step_per_worker: int | None = None
    path: str | None = None
    _initialized: bool = False

    def __new__(cls, *args: Any, **kwargs: Any) -> RolloutTraceConfig:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    @classmethod
    def get_instance(cls) -> RolloutTraceConfig:
        """The singleton (created unconfigured on first use)."""
        return cls()

    @classmethod
    def init(
        cls, project_name: str, experiment_name: str, backend: str | None, token2text: bool = False,
        max_samples_per_step_per_worker: int | None = None, *, path: str | None = None,
    ) -> None:
        """Configure tracing for this process; a second call is ignored (verl's behaviour).

        Args:
            project_name: verl's trace project; part of the default JSONL path.
            experiment_name: attached to every span as ``experiment_name``; part of the default
            path. backend: None / ``"none"`` (off), ``"jsonl"`` or ``"mlflow"``. token2text: add
            decoded ``prompt_text`` / ``response_text`` to traced outputs.
            max_samples_per_step_per_worker: how many samples per step a worker traces
                (see :func:`select_traced_rows`); None traces all.
            path: the JSONL file (agentloop extension); default ``$AGENTLOOP_TRACE_PATH`` or
                ``rollout_traces/<project_name>/<experiment_name>.jsonl``.

        Raises:
            ConfigError: an unsupported backend (verl's ``weave`` / ``trackio``), a negative
                ``max_samples_per_step_per_worker``, or ``mlflow`` without MLflow installed.
        """
        config = cls.get_instance()
        if config._initialized:
            return
        name = None if backend in (None, "", "none") else str(backend)
        if name not in SUPPORTED_BACKENDS:
            extra = (
                " (verl backend; agentloop does not implement it)"
                if name in VERL_ONLY_BACKENDS
                else ""
            )
            raise ConfigError(
                f"rollout trace backend {backend!r}{extra} is not supported; supported: "
                f"null (off), 'jsonl' and "
                "'mlflow'. Set actor_rollout_ref.rollout.trace.backend to one of them (the "
                "JSONL file is "
                f"${TRACE_PATH_ENV}, default rollout_traces/<project_name>/<experiment_name>.jsonl)"
            )
        if max_samples_per_step_per_worker is not None and int(max_samples_per_step_per_worker) < 0:
            raise ConfigError(
                f"max_samples_per_step_per_worker must be >= 0 or null, got "
                f"{max_samples_per_step_per_worker}"
            )
        if name == "jsonl":
            path = path or os.environ.get(TRACE_PATH_ENV) or os.path.join(
                "rollout_traces", str(project_name), f"{experiment_name}.jsonl"
            )
            configure("jsonl", path)
        elif name == "mlflow":  # MLFLOW_TRACKING_URI, else a SQLite file under ./rollout_traces
            path = os.environ.get("MLFLOW_TRACKING_URI")
            configure("mlflow", path, experiment=str(project_name))
        else:
            path = None
            configure("none")
        config.backend, config.path, config.token2text = name, path, bool(token2text)
        config.project_name, config.experiment_name = project_name, experiment_name
        config.max_samples_per_step_per_worker = (
            None
            if max_samples_per_step_per_worker is None
            else int(max_samples_per_step_per_worker)
        )
        config._initialized = True

    @classmethod
    def get_backend(cls) -> str | None:
        """``"jsonl"``, ``"mlflow"`` or None."""
        return cls.get_instance().backend

    @classmethod
    def get_client(cls) -> object | None:
        """Always None (verl returns the weave / mlflow client)."""
        return cls.get_instance().client

    @classmethod
    def enable_token2text(cls) -> bool:
        """Whether traced outputs get decoded text."""
        return cls.get_instance().token2text

    @classmethod
    def reset(cls) -> None:
        """Forget the settings and turn tracing off (a later ``init`` configures again)."""
        cls._instance = None
        configure("none")


def select_traced_rows(
    index: Sequence[Any], max_samples_per_step_per_worker: int | None, seed: int | None = None
) -> set[int]:
    """Rows a worker traces in one step: every rollout of up to ``max_samples`` randomly chosen
    samples.

    ``index`` is the per-row sample index (rows of one sample share it); None traces every row.
    """
    rows = range(len(index))
    if max_samples_per_step_per_worker is None:
        return set(rows)
    unique = sorted(set(index), key=str)
    if max_samples_per_step_per_worker >= len(unique):
        return set(rows)
    chosen = set(random.Random(seed).sample(unique, max_samples_per_step_per_worker))
    return {i for i in rows if index[i] in chosen}


@contextmanager
def rollout_trace_attr(
    sample_index: Any = None, step: Any = None, rollout_n: Any = None, name: str = "rollout_trace",
    validate: bool = False, trace: bool = True,
) -> Iterator[None]:
    """Attach one trajectory's attributes to the spans recorded inside the block
    (docs/tracing.md)."""
    if not enabled():
        yield
        return
    if not trace:
        with suppressed():
            yield
        return
    attrs: dict[str, Any] = {"validate": validate}
    for key, value in (("sample_index", sample_index), ("step", step), ("rollout_n", rollout_n)):
        if value is not None:
            attrs[key] = value
    experiment = RolloutTraceConfig.get_instance().experiment_name
    if experiment is not None:
        attrs["experiment_name"] = experiment
    with trace_attributes(**attrs), span(name):
        yield


def _bind_inputs(
    signature: inspect.Signature, drop_first: bool, args: tuple, kwargs: dict
) -> dict[str, Any]:
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:  # the call itself is wrong: let the function raise its own error
        return {"args": args[1:] if drop_first else args, "kwargs": kwargs}
    bound.apply_defaults()
    inputs = dict(bound.arguments)
    if drop_first:
        inputs.pop(next(iter(signature.parameters)), None)
    return inputs


def _field(value: Any, key: str) -> Any:
    return value.get(key) if isinstance(value, dict) else getattr(value, key, None)


def _with_text(instance: Any, inputs: dict[str, Any], output: Any) -> Any:
    """verl's token2text: a copy of ``output`` with ``prompt_text`` / ``response_text`` decoded."""
    decode = getattr(getattr(instance, "tokenizer", None), "decode", None)
    if not callable(decode):
        return output
    prompt_ids = _field(output, "prompt_ids")
    if prompt_ids is None:
        prompt_ids = inputs.get("prompt_ids")
    response_ids = _field(output, "response_ids")
    if response_ids is None:
        response_ids = _field(output, "token_ids")
    if prompt_ids is None and response_ids is None:
        return output
    if isinstance(output, BaseModel):
        copy = output.model_dump()
    elif isinstance(output, dict):
        copy = dict(output)
    elif hasattr(output, "__dict__"):
        copy = dict(vars(output))
    else:
        return output
    if prompt_ids is not None:
        copy["prompt_text"] = decode(list(prompt_ids))
    if response_ids is not None:
        copy["response_text"] = decode(list(response_ids))
    return copy


def _traced_output(instance: Any, inputs: dict[str, Any], result: Any) -> Any:
    if RolloutTraceConfig.get_instance().token2text:
        try:
            return _with_text(instance, inputs, result)
        except Exception as e:  # noqa: BLE001 - tracing never breaks a rollout
            return {"output": result, "token2text_error": f"{type(e).__name__}: {e}"}
    return result


def rollout_trace_op(func: F) -> F:
    """Trace calls of ``func`` (a method, async or not) as spans (docs/tracing.md)."""
    signature = inspect.signature(func)
    params = list(signature.parameters)
    drop_first = bool(params) and params[0] in ("self", "cls")
    span_name = func.__qualname__

    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_traced(*args: Any, **kwargs: Any) -> Any:
            if not enabled():
                return await func(*args, **kwargs)
            inputs = _bind_inputs(signature, drop_first, args, kwargs)
            with span(span_name, inputs=inputs) as s:
                result = await func(*args, **kwargs)
                s.outputs = _traced_output(args[0] if drop_first else None, inputs, result)
            return result

        return async_traced  # type: ignore[return-value]

    @functools.wraps(func)
    def traced(*args: Any, **kwargs: Any) -> Any:
        if not enabled():
            return func(*args, **kwargs)
        inputs = _bind_inputs(signature, drop_first, args, kwargs)
        with span(span_name, inputs=inputs) as s:
            result = func(*args, **kwargs)
            s.outputs = _traced_output(args[0] if drop_first else None, inputs, result)
        return result

    return traced  # type: ignore[return-value]


def __getattr__(name: str) -> object:
    if name.startswith("__"):
        raise AttributeError(name)
    raise MissingVerlNameError(missing_verl_name("verl.utils.rollout_trace", name))
