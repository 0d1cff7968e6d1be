"""``fp8rl compare``: per-run reductions, grouping by sweep axes, mean/std over seeds, .md/.csv output.

Runs are written straight into a sqlite MLflow store (no training), shaped like a sweep's children.
"""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path

import pytest
from mlflow.entities import Metric

from fp8rl.launch.parent import ensure_parent
from fp8rl.report.compare import compare, parse_metrics
from fp8rl.report.frames import Column, grouped, reduce_values, runs_frame
from fp8rl.tracking import store as mlflow_runs

pytestmark = pytest.mark.timeout(300)
# arm -> seed -> eval/accuracy at steps 0, 1, 2 (entropy is accuracy + 1)
ACCURACY = {"fp8": {0: [0.1, 0.2, 0.3], 1: [0.1, 0.2, 0.5]}, "cc": {0: [0.1, 0.6, 0.7], 1: [0.1, 0.6, 0.9]}}


def _fake_sweep(uri: str) -> None:
    client = mlflow_runs.client(uri)
    exp = mlflow_runs.experiment_id(client, "cmp", create=True)
    parent = ensure_parent(client, exp, "cmp", {"fp8rl.axes": "sweep.arm,sweep.trainer.seed"})
    now = int(time.time() * 1000)
    for arm, seeds in ACCURACY.items():
        for seed, values in seeds.items():
            tags = {
                mlflow_runs.HASH_TAG: f"{arm}{seed}",
                "mlflow.parentRunId": parent,
                "sweep.arm": arm,
                "sweep.trainer.seed": str(seed),
                "recipe": "blockwise",
            }
            run_id = client.create_run(exp, tags=tags, run_name=f"{arm}-s{seed}").info.run_id
            metrics = [Metric("eval/accuracy", v, now, step) for step, v in enumerate(values)]
            metrics += [Metric("rollout/entropy", v + 1, now, step) for step, v in enumerate(values)]
            client.log_batch(run_id, metrics=metrics, params=[])
            client.log_param(run_id, "clipping.interval", "20")
            client.set_terminated(run_id, "FINISHED")
    unfinished = client.create_run(exp, tags={mlflow_runs.HASH_TAG: "x", "sweep.arm": "fp8"}).info.run_id
    client.log_metric(unfinished, "eval/accuracy", 99.0, step=0)


def test_parse_and_reduce() -> None:
    specs = parse_metrics("eval/accuracy,rollout/entropy:max, clip/low_neg:mean")
    assert [(s.key, s.reduce) for s in specs] == [
        ("eval/accuracy", "last"),
        ("rollout/entropy", "max"),
        ("clip/low_neg", "mean"),
    ]
    assert parse_metrics(None)[0].key == "eval/accuracy"
    values = [1, 3, 2]
    assert (reduce_values(values, "last"), reduce_values(values, "max"), reduce_values(values, "mean")) == (2, 3, 2)
    assert math.isnan(reduce_values([], "min"))


def test_compare_groups_by_the_sweep_axes_and_writes_md_and_csv(tmp_path: Path, sqlite_uri: str) -> None:
    _fake_sweep(sqlite_uri)
    metrics = "eval/accuracy,rollout/entropy:max,eval/accuracy:mean,missing/metric"
    table, paths = compare("cmp", metrics, None, tmp_path / "out", sqlite_uri)
    by_arm = table.set_index("sweep.arm")
    assert sorted(by_arm.index) == ["cc", "fp8"], "seeds are not a grouping axis; the unfinished run is left out"
    last, peak, mean, missing = (c.label for c in parse_metrics(metrics))
    assert by_arm.loc["fp8", "runs"] == 2 and by_arm.loc["cc", "runs"] == 2
    assert by_arm.loc["fp8", f"{last}:mean"] == pytest.approx(0.4)
    assert by_arm.loc["fp8", f"{last}:std"] == pytest.approx(math.sqrt(0.02))
    assert by_arm.loc["cc", f"{peak}:mean"] == pytest.approx(1.8)
    assert by_arm.loc["cc", f"{mean}:mean"] == pytest.approx((0.1 + 0.6 + 0.7 + 0.1 + 0.6 + 0.9) / 6)
    assert math.isnan(by_arm.loc["cc", f"{missing}:mean"])
    md, grouped_csv, per_run = paths
    text = md.read_text()
    assert "| sweep.arm   |   runs | eval/accuracy (last)" in text and "| cc          |      2 | 0.8 ± 0.1414" in text
    rows = list(csv.DictReader(grouped_csv.open()))  # tidy: one row per arm and metric, identifier names
    assert [r["metric"] for r in rows[:4]] == [
        "eval_accuracy_last", "rollout_entropy_max", "eval_accuracy_mean", "missing_metric_last"
    ]  # fmt: skip
    accuracy = {r["sweep.arm"]: (r["n"], float(r["mean"])) for r in rows if r["metric"] == "eval_accuracy_last"}
    assert accuracy == {"fp8": ("2", pytest.approx(0.4)), "cc": ("2", pytest.approx(0.8))}
    assert {r["n"] for r in rows if r["metric"] == "missing_metric_last"} == {"0"}
    per_run_rows = list(csv.DictReader(per_run.open()))
    assert len(per_run_rows) == 4 and "eval_accuracy_last" in per_run_rows[0]
    assert "mlflow.db" in text and str(tmp_path) not in text  # the store, without this machine's path


def test_group_by_tags_and_params(sqlite_uri: str) -> None:
    _fake_sweep(sqlite_uri)
    table, _ = compare("cmp", "eval/accuracy", ["recipe", "clipping.interval", "seed"], None, sqlite_uri)
    groups = [(tuple(row[:3]), row[3]) for row in table[["recipe", "clipping.interval", "seed", "runs"]].values]
    assert groups == [(("blockwise", "20", "0"), 2), (("blockwise", "20", "1"), 2)]
    table, _ = compare("cmp", "eval/accuracy", ["arm"], None, sqlite_uri, include_unfinished=True)
    assert dict(zip(table["arm"], table["runs"], strict=True)) == {"fp8": 3, "cc": 2}


def test_a_single_run_has_zero_std_and_a_missing_metric_is_nan() -> None:
    from fp8rl.report.frames import RunData

    column, absent = Column("a", "a"), Column("b", "b")
    run = RunData("r", "n", ("g",), {}, {}, {"a": [(0, 1.0), (1, 2.0)]})
    table = grouped(runs_frame([run], [column, absent], ["arm"]), ["arm"], [column, absent])
    assert (table.loc[0, "a:mean"], table.loc[0, "a:std"]) == (2.0, 0.0)
    assert math.isnan(table.loc[0, "b:mean"]) and math.isnan(table.loc[0, "b:std"])


@pytest.mark.parametrize(
    ("params", "before", "after"),
    [
        ({"clipping.interval": "5"}, 3.5, 8.5),  # calibration on step index 5, in force from logged step 7
        ({"clipping.interval": "5", "clipping.first_step": "None"}, 3.5, 8.5),
        ({"clipping.interval": "5", "clipping.first_step": "0"}, 1.0, 6.0),  # in force from logged step 2
    ],
)
def test_a_run_splits_where_its_schedule_first_puts_calibrated_bounds_in_force(params, before, after) -> None:
    from fp8rl.report.frames import RunData

    run = RunData("r", "n", ("g",), {}, params, {"clip/low_neg": [(step, float(step)) for step in range(1, 11)]})
    columns = [Column(window, "clip/low_neg", window) for window in ("mean_initial_bounds", "mean_calibrated_bounds")]
    assert [run.reduced(c) for c in columns] == [before, after]
    assert all(math.isnan(RunData("r", "n", ("g",), {}, {}, run.history).reduced(c)) for c in columns)


@pytest.mark.parametrize("first_step", ["None", "0"])
def test_the_k_windows_are_the_same_steps_for_every_schedule_and_a_lag_reads_the_step_before(first_step) -> None:
    from fp8rl.report.frames import RunData

    params = {"clipping.interval": "3", "clipping.first_step": first_step}
    run = RunData("r", "n", ("g",), {}, params, {"clip/bound_low": [(step, float(step)) for step in range(1, 11)]})
    early, late = (Column(w, "clip/bound_low", w) for w in ("mean_steps_2_to_k1", "mean_steps_from_k2"))
    assert (run.reduced(early), run.reduced(late)) == (3.0, 7.5)  # steps 2-4 and 5-10
    lagged = Column("in force", "clip/bound_low", "mean_steps_2_to_k1", lag=1)
    assert run.reduced(lagged) == 2.0  # the values logged at steps 1-3
    with pytest.raises(ValueError, match="lag"):
        Column("x", "clip/bound_low", "mean", lag=1)
