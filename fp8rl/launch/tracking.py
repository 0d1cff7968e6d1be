"""The tracker a launched job hands the trainer: MLflow uploads off the training loop's critical path,
plus launch-overhead metrics.

`AsyncTracker` wraps the trainer's tracker (`fp8rl.tracking.MlflowTracker`). `log_metrics` appends the
step's record to a write-ahead log in the run folder (a local append, well under a millisecond) and
returns; one background thread makes the real calls, in order (the wrapped tracker buffers them
durably itself and uploads with one ``log_batch`` per step), then drops them from the log. A job
killed with records still in the log replays them on its next start: the wrapped tracker skips steps
MLflow already has, so every step is logged exactly once even when the kill lands between a step's log
call and the checkpoint written right after it.

Metrics it adds: ``time/tracking_log`` (seconds the loop was blocked by the previous log call) and
``time/tracking_upload`` (seconds the background upload of the previous step took, off the critical
path); with step 1, ``launch/submit_to_first_step_s`` and ``launch/queue_s`` (see `TrainJob`).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
DRAIN_TIMEOUT_S = 300.0  # finish() waits this long for pending uploads (the wrapped tracker keeps the rest)


class AsyncTracker:
    """Wraps a tracker; see the module docstring. ``wal_path``: the write-ahead log of pending steps."""

    def __init__(self, inner: Any, wal_path: str | Path, submitted_at: float, started_at: float) -> None:
        self.inner = inner
        self.run_id = inner.run_id
        self.wal_path = Path(wal_path)
        self.submitted_at, self.started_at = submitted_at, started_at
        self._calls: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._wal_lock = threading.Lock()
        self._pending = 0  # records in the WAL not yet handed to the wrapped tracker
        self._error: BaseException | None = None
        self._last_log_s: float | None = None
        self._last_upload_s: float | None = None
        self._replay()
        self._worker = threading.Thread(target=self._work, name="fp8rl-tracking", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------------------------ Tracker protocol
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        t0 = time.perf_counter()
        self._raise_worker_error()
        record = {"step": step, "metrics": {**metrics, **self._extra(metrics, step)}}
        with self._wal_lock:
            self.wal_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.wal_path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
            self._pending += 1
        self._calls.put(lambda: self._upload(record))
        self._last_log_s = time.perf_counter() - t0

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._calls.put(lambda: self.inner.log_artifact(path, artifact_path))

    def last_logged_step(self) -> int:
        return self.inner.last_logged_step()

    def finish(self, status: str = "FINISHED") -> None:
        """Drain pending uploads (bounded), then finish the wrapped run."""
        self._calls.put(None)
        self._worker.join(DRAIN_TIMEOUT_S)
        if self._worker.is_alive():
            log.error("tracking uploads still pending after %.0fs; they stay in %s", DRAIN_TIMEOUT_S, self.wal_path)
            return
        self.inner.finish(status)
        self._raise_worker_error()

    def __getattr__(self, name: str) -> Any:  # log_params, set_tags, ...: synchronous, before the loop starts
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ------------------------------------------------------------------------------------ internals
    def _extra(self, metrics: dict[str, float], step: int) -> dict[str, float]:
        extra = {}
        if self._last_log_s is not None:
            extra["time/tracking_log"] = self._last_log_s
        if self._last_upload_s is not None:
            extra["time/tracking_upload"] = self._last_upload_s
        if step == 1:
            first_step_start = time.time() - float(metrics.get("time/step", 0.0))
            extra["launch/submit_to_first_step_s"] = first_step_start - self.submitted_at
            extra["launch/queue_s"] = self.started_at - self.submitted_at
        return extra

    def _upload(self, record: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        self.inner.log_metrics(record["metrics"], record["step"])  # durable in its own buffer from here on
        self._last_upload_s = time.perf_counter() - t0
        with self._wal_lock:
            self._pending -= 1
            if self._pending == 0:
                self.wal_path.unlink(missing_ok=True)

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            try:
                call()
            except BaseException as err:  # noqa: BLE001 - surfaced in the training thread at its next call
                self._error = err
                log.exception("tracking call failed")

    def _replay(self) -> None:
        """Hand records a killed predecessor left in the WAL to the wrapped tracker (it skips stored steps)."""
        _drop_torn_lines(getattr(self.inner, "buffer_path", None))
        if not self.wal_path.exists():
            return
        records = [r for r in map(_parse, self.wal_path.read_text().splitlines()) if r is not None]
        for record in records:
            self.inner.log_metrics(record["metrics"], record["step"])
        self.wal_path.unlink()
        log.info("replayed %d pending tracking record(s) from %s", len(records), self.wal_path)

    def _raise_worker_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("a tracking call failed in the background") from err


def _parse(line: str) -> dict[str, Any] | None:
    """One WAL line; None for a line torn by a kill mid-write (its step is recomputed and logged after resume)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def _drop_torn_lines(path: Path | None) -> None:
    """A kill in the middle of the wrapped tracker's own buffer append leaves a torn JSON line that its
    flush cannot parse; drop it (the step is still in our WAL, which is replayed right after)."""
    if path is None or not Path(path).exists():
        return
    lines = Path(path).read_text().splitlines()
    kept = [line for line in lines if line.strip() and _parse(line) is not None]
    if len(kept) != len([line for line in lines if line.strip()]):
        Path(path).write_text("".join(line + "\n" for line in kept))
