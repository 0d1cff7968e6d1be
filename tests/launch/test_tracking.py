"""AsyncTracker: uploads leave the training loop's critical path, in order, and survive a kill (WAL replay)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from fp8rl.launch.tracking import AsyncTracker

pytestmark = pytest.mark.timeout(60)


class FakeTracker:
    """Stands in for MlflowTracker: slow uploads, and it skips steps the store already has."""

    run_id = "run"

    def __init__(self, last_step: int = -1, delay_s: float = 0.0, gate: threading.Event | None = None) -> None:
        self.last, self.delay_s, self.gate = last_step, delay_s, gate
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.artifacts: list[str] = []
        self.finished: str | None = None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.gate is not None:
            self.gate.wait()
        time.sleep(self.delay_s)
        if step > self.last:
            self.logged.append((step, metrics))
            self.last = step

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.artifacts.append(str(path))

    def last_logged_step(self) -> int:
        return self.last

    def finish(self, status: str = "FINISHED") -> None:
        self.finished = status


def test_log_calls_return_at_once_and_uploads_keep_their_order(tmp_path: Path) -> None:
    inner = FakeTracker(delay_s=0.5)
    tracker = AsyncTracker(inner, tmp_path / "wal.jsonl", submitted_at=time.time() - 5, started_at=time.time() - 1)
    t0 = time.perf_counter()
    for step in range(3):
        tracker.log_metrics({"time/step": 0.5, "x": float(step)}, step)
    tracker.log_artifact("a.json")
    assert time.perf_counter() - t0 < 0.75, "the loop waited for uploads (3 x 0.5 s)"
    while not inner.logged:  # the next step starts after an upload finished
        time.sleep(0.01)
    tracker.log_metrics({"time/step": 0.5, "x": 3.0}, 3)
    tracker.finish("FINISHED")
    assert [step for step, _ in inner.logged] == [0, 1, 2, 3] and inner.artifacts == ["a.json"]
    assert inner.finished == "FINISHED" and not (tmp_path / "wal.jsonl").exists()
    metrics = dict(inner.logged)
    assert metrics[1]["launch/submit_to_first_step_s"] == pytest.approx(4.5, abs=0.5)
    assert metrics[1]["launch/queue_s"] == pytest.approx(4.0, abs=0.1)
    assert metrics[2]["time/tracking_log"] < 0.25  # an append, not the 0.5 s upload
    assert metrics[3]["time/tracking_upload"] >= 0.5


def test_records_of_a_killed_job_are_replayed_once(tmp_path: Path) -> None:
    wal = tmp_path / "wal.jsonl"
    stuck = FakeTracker(gate=threading.Event())  # uploads never happen: the job is killed before them
    killed = AsyncTracker(stuck, wal, 0.0, 0.0)
    for step in (1, 2, 3):
        killed.log_metrics({"x": float(step)}, step)
    assert len(wal.read_text().splitlines()) == 3 and stuck.logged == []
    with open(wal, "a") as fh:
        fh.write('{"step": 4, "metrics": {"x"')  # torn by the kill
    store = FakeTracker(last_step=1)  # step 1 reached MLflow before the kill
    store.buffer_path = tmp_path / "buffer.jsonl"  # the wrapped tracker's own buffer, torn by the kill too
    store.buffer_path.write_text('{"step": 1, "metrics": {}}\n{"step": 2, "met')
    resumed = AsyncTracker(store, wal, 0.0, 0.0)
    assert store.buffer_path.read_text() == '{"step": 1, "metrics": {}}\n'  # its flush would choke on the torn line
    assert [step for step, _ in store.logged] == [2, 3] and not wal.exists()
    resumed.log_metrics({"x": 3.5}, 3)  # the resumed trainer recomputes step 3: already stored, skipped
    resumed.log_metrics({"x": 4.0}, 4)
    resumed.finish()
    assert [step for step, _ in store.logged] == [2, 3, 4]
    stuck.gate.set()


def test_a_failed_background_call_surfaces_in_the_loop(tmp_path: Path) -> None:
    class Broken(FakeTracker):
        def log_metrics(self, metrics: dict[str, float], step: int) -> None:
            raise ValueError("boom")

    tracker = AsyncTracker(Broken(), tmp_path / "wal.jsonl", 0.0, 0.0)
    tracker.log_metrics({"x": 1.0}, 1)
    deadline = time.monotonic() + 10
    while tracker._error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="tracking call failed") as err:
        tracker.log_metrics({"x": 2.0}, 2)
    assert isinstance(err.value.__cause__, ValueError)
