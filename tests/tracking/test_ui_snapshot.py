"""`make ui-snapshot` photographs the MLflow UI with headless Chromium (needs Debian's chromium and the `ui`
extra; skipped, with a reason, without them)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fp8rl.config import TaskConfig
from fp8rl.tasks.base import Problem
from fp8rl.tracking import MlflowTracker, RunSpec
from fp8rl.tracking.datasets import task_datasets
from fp8rl.tracking.ui_snapshot import BROWSERS, pages
from fp8rl.trainer.shadow import ratio_histogram_figure


def test_every_view_the_issue_names_is_photographed() -> None:
    todo = pages("7", {"bf16": "a", "cc": "b"}, "figures/ratio_histograms/step_000002.png")
    names = [p.name for p in todo]
    assert names == ["runs_table", "chart_view", "run_bf16", "run_cc", "run_cc_artifacts", "compare_runs"]
    assert todo[1].chart_search and "clip/bound" in todo[1].chart_search
    assert todo[4].route.endswith("/runs/b/artifacts/figures/ratio_histograms/step_000002.png")
    assert "%5B%22a%22%2C%20%22b%22%5D" in todo[5].route  # both runs compared


def _tracked_run(uri: str, folder: Path, name: str) -> None:
    spec = RunSpec(uri, "ui", name, tags={"fp8rl.config_hash": name}, description=f"**{name}**", system_metrics=False)
    tracker = MlflowTracker(spec, folder / name, connect_timeout_s=5, offline_ok=False)
    problems = [Problem("1+2=", "3"), Problem("2+2=", "4")]
    tracker.log_datasets(lambda: task_datasets(TaskConfig(), problems, {"heldout": problems}))
    for step in (1, 2, 3):
        tracker.log_metrics({"rollout/entropy": 0.2 + step / 100, "clip/bound_low": 0.8 - step / 100}, step)
    hist = {
        "step": 2,
        "edges": [0.5, 1.0, 1.5],
        **{k: [1.0, 2.0] for k in ("fp8_neg", "fp8_pos", "bf16_neg", "bf16_pos")},
    }
    tracker.log_figure(ratio_histogram_figure(hist), "ratio_histograms/step_000002.png")
    tracker.finish()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_snapshot_of_a_small_store_writes_every_page(tmp_path: Path, sqlite_uri: str, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # anything written to the working directory lands in the test's folder
    pytest.importorskip("playwright", reason="the `ui` extra (pip install -e '.[ui]') is not installed")
    if not any(shutil.which(name) for name in BROWSERS):
        pytest.skip("no Chromium: apt-get install chromium (make ui-snapshot does)")
    from fp8rl.tracking.ui_snapshot import snapshot

    for name in ("bf16", "cc"):
        _tracked_run(sqlite_uri, tmp_path, name)
    written = snapshot(sqlite_uri, "ui", tmp_path / "ui")
    shots = [p for p in written if p.suffix == ".png"]
    assert len(shots) == 6 and all(p.stat().st_size > 20_000 for p in shots)
    record = json.loads((tmp_path / "ui" / "PROVENANCE.json").read_text())
    assert set(record["runs"]) == {"bf16", "cc"} and str(tmp_path) not in json.dumps(record)
