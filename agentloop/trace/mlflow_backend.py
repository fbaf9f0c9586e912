"""The ``mlflow`` trace backend: one MLflow trace per sample, its generate / tool / interaction
spans inside.

Spans reach :meth:`MlflowBackend.write` as finished records (children before their parent: a span is
recorded when it ends).  Records wait in memory until their root span ends (the sample's
``agent_loop`` span, opened by ``rollout_trace_attr``); the root and everything under it then go to
a background thread that writes one trace with the recorded start / end times, so the worker's event
loop never waits on the store. Records with no root left at :meth:`close` become traces of their
own.

Store: ``MLFLOW_TRACKING_URI`` when set, else ``sqlite:///<cwd>/rollout_traces/mlflow.db``;
experiment: the trace config's ``project_name``.  Look at it with
``mlflow ui --backend-store-uri sqlite:///rollout_traces/mlflow.db`` (docs/tracing.md).  Needs
``pip install agentloop[trace]`` (mlflow-skinny, sqlalchemy, alembic).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from agentloop.errors import ConfigError
from agentloop.trace.jsonl import to_jsonable

logger = logging.getLogger(__name__)


def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI``, else a SQLite file under ``./rollout_traces``."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    path = Path("rollout_traces").absolute()
    path.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path / 'mlflow.db'}"


class MlflowBackend:
    """See the module docstring."""

    name = "mlflow"

    def __init__(self, tracking_uri: str | None = None, experiment: str = "agentloop") -> None:
        try:
            # our own thread writes
            os.environ.setdefault("MLFLOW_ENABLE_ASYNC_TRACE_LOGGING", "false")
            import mlflow  # optional dependency (the trace extra)
            from mlflow import MlflowClient  # optional dependency (the trace extra)
        except ImportError as e:
            raise ConfigError(
                "rollout.trace.backend: mlflow needs MLflow: pip install "
                "'agentloop[trace]' "
                f"(mlflow-skinny, sqlalchemy, alembic); import failed: {e}"
            ) from e
        self.tracking_uri = tracking_uri or default_tracking_uri()
        # MLflow's span exporter writes to the process-wide store
        mlflow.set_tracking_uri(self.tracking_uri)
        # unused; skinny needs one
        registry = f"file://{Path('rollout_traces').absolute() / 'registry'}"
        self._client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=registry)
        found = self._client.get_experiment_by_name(experiment)
        self.experiment_id = found.experiment_id if found else self._create_experiment(experiment)
        self._pending: dict[str, dict[str, Any]] = {}
        self._queue: queue.Queue[list[dict[str, Any]] | None] = queue.Queue()
        self._thread = threading.Thread(
            target=self._drain, name="agentloop-mlflow-traces", daemon=True
        )
        self._thread.start()

    def _create_experiment(self, name: str) -> str:
        try:
            return str(self._client.create_experiment(name))
        except Exception:  # noqa: BLE001 - another worker created it meanwhile
            found = self._client.get_experiment_by_name(name)
            if found is None:
                raise
            return str(found.experiment_id)

    def write(self, record: dict[str, Any]) -> None:
        """Keep ``record``; when it is a root span, hand it and its descendants to the writer
        thread."""
        self._pending[record["span_id"]] = record
        if record.get("parent_id") is None:
            self._queue.put(self._take_tree(record["span_id"]))

    def _take_tree(self, root: str) -> list[dict[str, Any]]:
        def reaches_root(span_id: str | None) -> bool:
            seen = 0
            while span_id is not None and seen < 1000:
                if span_id == root:
                    return True
                parent = self._pending.get(span_id)
                span_id = parent.get("parent_id") if parent else None
                seen += 1
            return False

        tree = [r for sid, r in self._pending.items() if reaches_root(sid)]
        for r in tree:
            self._pending.pop(r["span_id"], None)
        return tree

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every trace handed over so far is written."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        """Write what is left (spans whose root never ended become traces of their own) and stop
        the thread."""
        while self._pending:
            top = next(
                s for s, r in self._pending.items() if r.get("parent_id") not in self._pending
            )
            self._queue.put(self._take_tree(top))
        self._queue.put(None)
        self._thread.join(timeout=60)

    # ------------------------------------------------------------------------------ writer thread
    def _drain(self) -> None:
        while True:
            tree = self._queue.get()
            try:
                if tree is None:
                    return
                for attempt in range(3):  # SQLite may be busy with another worker's write
                    try:
                        self._write_trace(tree)
                        break
                    except Exception as e:  # noqa: BLE001 - a trace never fails the rollout
                        if attempt == 2:
                            logger.warning(
                                "could not write a rollout trace to %s: %s", self.tracking_uri, e
                            )
                        time.sleep(0.2 * (attempt + 1))
            finally:
                self._queue.task_done()

    def _write_trace(self, tree: list[dict[str, Any]]) -> None:
        client = self._client
        ids = {r["span_id"] for r in tree}
        root = next(r for r in tree if r.get("parent_id") not in ids)
        attrs = {k: str(v) for k, v in (root.get("attrs") or {}).items()}
        trace = client.start_trace(
            root["name"], inputs=to_jsonable(root.get("inputs") or root.get("attrs")),
            attributes=attrs, experiment_id=self.experiment_id,
            start_time_ns=int(root["start"] * 1e9),
        )
        mlflow_ids = {root["span_id"]: trace.span_id}
        for r in sorted((r for r in tree if r is not root), key=lambda r: r["start"]):
            parent = mlflow_ids.get(r.get("parent_id"), trace.span_id)
            span = client.start_span(
                r["name"], trace_id=trace.trace_id, parent_id=parent,
                inputs=to_jsonable(r.get("inputs")), attributes=to_jsonable(r.get("attrs")),
                start_time_ns=int(r["start"] * 1e9),
            )
            mlflow_ids[r["span_id"]] = span.span_id
            client.end_span(
                trace.trace_id, span.span_id, outputs=to_jsonable(r.get("outputs")),
                attributes={"error": r["error"]} if r.get("error") else None,
                status="ERROR" if r.get("error") else "OK", end_time_ns=int(r["end"] * 1e9),
            )
        client.end_trace(
            trace.trace_id, outputs=to_jsonable(root.get("outputs")),
            status="ERROR" if root.get("error") else "OK", end_time_ns=int(root["end"] * 1e9),
        )
