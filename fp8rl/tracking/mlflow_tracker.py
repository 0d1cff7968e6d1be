"""MLflow tracking with batched per-step metrics, local buffering when the server is away, and resume.

The trainer is handed a `Tracker`; the maths never imports this module. Metrics of one step go out in
one `log_batch` call. If a call fails (server unreachable), the metrics are appended to a local JSONL
buffer and retried at the next step and at the end, so nothing is lost. A resumed run continues the
same MLflow run and skips steps MLflow already has, so no step is logged twice.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
PARAM_VALUE_LIMIT = 500


class Tracker(Protocol):
    """What the trainer needs from experiment tracking."""

    run_id: str | None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def last_logged_step(self) -> int: ...
    def finish(self, status: str = "FINISHED") -> None: ...


class NullTracker:
    """Tracks nothing (tests, or tracking disabled); remembers metrics in memory for inspection."""

    def __init__(self) -> None:
        self.run_id: str | None = None
        self.history: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.history.append((step, dict(metrics)))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        return None

    def last_logged_step(self) -> int:
        return self.history[-1][0] if self.history else -1

    def finish(self, status: str = "FINISHED") -> None:
        return None


def resolve_tracking_uri(configured: str | None) -> str:
    """Config value, else $MLFLOW_TRACKING_URI, else a sqlite store in the working directory."""
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


class MlflowTracker:
    """One MLflow run: params, tags, batched metrics with a local fallback buffer, artifacts."""

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        run_name: str,
        buffer_path: str | Path,
        resume_run_id: str | None = None,
        parent_run_id: str | None = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.tracking_uri = tracking_uri
        self.buffer_path = Path(buffer_path)
        self._last_step_in_store = -1
        if resume_run_id:
            self.run_id = resume_run_id
            self.client.update_run(resume_run_id, status="RUNNING")
            self._last_step_in_store = self._max_logged_step()
        else:
            experiment_id = self._experiment_id(experiment)
            all_tags = dict(tags or {})
            all_tags["mlflow.runName"] = run_name
            if parent_run_id:
                all_tags["mlflow.parentRunId"] = parent_run_id
            self.run_id = self.client.create_run(experiment_id, tags=all_tags, run_name=run_name).info.run_id

    def _experiment_id(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found else self.client.create_experiment(name)

    def _max_logged_step(self) -> int:
        run = self.client.get_run(self.run_id)
        steps = [-1]
        for key in list(run.data.metrics)[:5]:
            steps.extend(m.step for m in self.client.get_metric_history(self.run_id, key))
        return max(steps)

    def last_logged_step(self) -> int:
        return self._last_step_in_store

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:PARAM_VALUE_LIMIT]) for k, v in params.items()]
        for start in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[start : start + 100])

    def set_tags(self, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, str(value))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log one step's metrics in a single call; skip steps already in the store (resume)."""
        if step <= self._last_step_in_store:
            return
        record = {"step": step, "timestamp": int(time.time() * 1000), "metrics": _finite(metrics)}
        self._append_buffer(record)
        self.flush()

    def _append_buffer(self, record: dict) -> None:
        self.buffer_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.buffer_path, "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def flush(self) -> bool:
        """Upload buffered steps; on failure keep them for the next try. Returns True when empty."""
        if not self.buffer_path.exists():
            return True
        from mlflow.entities import Metric

        records = _read_records(self.buffer_path)
        try:
            for rec in records:
                if rec["step"] <= self._last_step_in_store:
                    continue
                metrics = [Metric(k, v, rec["timestamp"], rec["step"]) for k, v in rec["metrics"].items()]
                for start in range(0, len(metrics), 1000):
                    self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])
                self._last_step_in_store = rec["step"]
        except Exception as err:  # noqa: BLE001 - any transport error means "try later"
            log.warning("MLflow unreachable (%s); %d step(s) buffered in %s", err, len(records), self.buffer_path)
            remaining = [r for r in records if r["step"] > self._last_step_in_store]
            self.buffer_path.write_text("".join(json.dumps(r) + "\n" for r in remaining))
            return False
        self.buffer_path.unlink()
        return True

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        try:
            self.client.log_artifact(self.run_id, str(path), artifact_path)
        except Exception as err:  # noqa: BLE001
            log.warning("could not log artifact %s: %s", path, err)

    def finish(self, status: str = "FINISHED") -> None:
        flushed = self.flush()
        if not flushed:
            log.error("metrics left in %s: MLflow was unreachable at the end of the run", self.buffer_path)
        self.client.set_terminated(self.run_id, status=status)


def _read_records(path: Path) -> list[dict]:
    """Buffered steps; a line torn by a kill mid-write is skipped (its step is re-run on resume)."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("skipping a torn line in %s", path)
    return records


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    """MLflow rejects NaN in some stores; non-finite values are logged as NaN-free sentinels dropped here."""
    return {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
