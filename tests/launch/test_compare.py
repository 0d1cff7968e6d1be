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

from fp8rl.launch import runs as mlflow_runs
from fp8rl.launch.compare import aggregate, compare, parse_metrics, reduce

pytestmark = pytest.mark.timeout(300)
# arm -> seed -> eval/accuracy at steps 0, 1, 2 (entropy is accuracy + 1)
ACCURACY = {"fp8": {0: [0.1, 0.2, 0.3], 1: [0.1, 0.2, 0.5]}, "cc": {0: [0.1, 0.6, 0.7], 1: [0.1, 0.6, 0.9]}}


def _fake_sweep(uri: str) -> None:
    client = mlflow_runs.client(uri)
    exp = mlflow_runs.experiment_id(client, "cmp", create=True)
    parent = mlflow_runs.ensure_parent(client, exp, "cmp", {"fp8rl.axes": "sweep.arm,sweep.trainer.seed"})
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
    assert [(s.key, s.agg) for s in specs] == [
        ("eval/accuracy", "last"),
        ("rollout/entropy", "max"),
        ("clip/low_neg", "mean"),
    ]
    assert parse_metrics(None)[0].key == "eval/accuracy"
    assert (reduce([1, 3, 2], "last"), reduce([1, 3, 2], "max"), reduce([1, 3, 2], "mean")) == (2, 3, 2)
    assert math.isnan(reduce([], "min"))


def test_compare_groups_by_the_sweep_axes_and_writes_md_and_csv(tmp_path: Path, sqlite_uri: str) -> None:
    _fake_sweep(sqlite_uri)
    metrics = "eval/accuracy,rollout/entropy:max,eval/accuracy:mean,missing/metric"
    groups, paths = compare("cmp", metrics, None, tmp_path / "out", sqlite_uri)
    by_arm = {g.group: g for g in groups}
    assert sorted(by_arm) == [("cc",), ("fp8",)], "seeds are not a grouping axis; the unfinished run is left out"
    last, peak, mean, missing = parse_metrics(metrics)
    fp8, cc = by_arm[("fp8",)], by_arm[("cc",)]
    assert (fp8.n, cc.n) == (2, 2)
    assert fp8.mean[last] == pytest.approx(0.4) and fp8.std[last] == pytest.approx(math.sqrt(0.02))
    assert cc.mean[peak] == pytest.approx(1.8)
    assert cc.mean[mean] == pytest.approx((0.1 + 0.6 + 0.7 + 0.1 + 0.6 + 0.9) / 6)
    assert math.isnan(cc.mean[missing])
    md, grouped, per_run = paths
    text = md.read_text()
    assert "| sweep.arm | runs | eval/accuracy (last) |" in text and "| cc | 2 | 0.8 ± 0.14 |" in text
    rows = list(csv.DictReader(grouped.open()))
    assert {r["sweep.arm"]: float(r["eval/accuracy:last:mean"]) for r in rows} == pytest.approx({"fp8": 0.4, "cc": 0.8})
    assert len(list(csv.DictReader(per_run.open()))) == 4


def test_group_by_tags_and_params(sqlite_uri: str) -> None:
    _fake_sweep(sqlite_uri)
    groups, _ = compare("cmp", "eval/accuracy", ["recipe", "clipping.interval", "seed"], None, sqlite_uri)
    assert [(g.group, g.n) for g in groups] == [(("blockwise", "20", "0"), 2), (("blockwise", "20", "1"), 2)]
    groups, _ = compare("cmp", "eval/accuracy", ["arm"], None, sqlite_uri, include_unfinished=True)
    assert {g.group: g.n for g in groups} == {("fp8",): 3, ("cc",): 2}


def test_aggregate_of_a_single_run_has_zero_std() -> None:
    from fp8rl.launch.compare import RunRow

    spec = parse_metrics("a")[0]
    (group,) = aggregate([RunRow("r", "n", ("g",), {spec: 2.0})], [spec])
    assert (group.mean[spec], group.std[spec]) == (2.0, 0.0)
