"""Re-runs of a config hash compared with the runs of the same hash in other experiments (fp8rl.report.reruns)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from mlflow.entities import Metric

from fp8rl.report.reruns import compare_histories, write_reruns
from fp8rl.tracking import store


def test_identical_histories_and_the_first_metric_that_differs() -> None:
    a = {"clip/low_neg": [(1, 0.5), (2, 0.25)], "eval/accuracy": [(2, 0.9)], "time/step": [(1, 3.0)]}
    b = {"clip/low_neg": [(1, 0.5), (2, 0.25)], "eval/accuracy": [(2, 0.875)], "time/step": [(1, 9.0)]}
    assert compare_histories(a, a).identical == 2  # time/ is the machine's, not compared
    result = compare_histories(a, b)
    assert (result.compared, result.identical, result.largest_difference) == (2, 1, pytest.approx(0.025))
    assert result.first_different == "eval/accuracy"
    assert compare_histories(a, {"clip/low_neg": [(1, 0.5)]}).identical == 0  # a missing step is a difference


def _run(client, experiment: str, config_hash: str, accuracy: float, status: str = "FINISHED") -> str:
    exp_id = store.experiment_id(client, experiment, create=True)
    run_id = client.create_run(exp_id, tags={store.HASH_TAG: config_hash}, run_name=config_hash).info.run_id
    client.log_batch(run_id, metrics=[Metric("eval/accuracy", accuracy, 0, 1), Metric("time/step", accuracy, 0, 1)])
    client.set_terminated(run_id, status)
    return run_id


def test_each_rerun_is_paired_with_the_other_runs_of_its_config_hash(sqlite_uri: str, tmp_path: Path) -> None:
    client = store.client(sqlite_uri)
    _run(client, "table", "same", 0.5)
    _run(client, "table", "drifted", 0.5)
    _run(client, "table", "failed", 0.5, status="FAILED")
    for config_hash, accuracy in (("same", 0.5), ("drifted", 0.75), ("failed", 0.5), ("new", 0.5)):
        _run(client, "ablation", config_hash, accuracy)
    md, csv_path = write_reruns("ablation", tmp_path, tracking_uri=sqlite_uri)
    rows = {row["config hash"]: row for row in csv.DictReader(csv_path.open())}
    assert set(rows) == {"same", "drifted"}  # no finished run of "failed" or "new" elsewhere
    assert (rows["same"]["identical"], rows["drifted"]["identical"]) == ("1", "0")
    assert rows["drifted"]["first differing metric"] == "eval/accuracy"
    assert "2 pair(s)" in md.read_text()


def test_a_nan_in_both_histories_is_identical() -> None:
    nan = float("nan")
    assert compare_histories({"clip/p": [(1, nan)]}, {"clip/p": [(1, nan)]}).identical == 1
