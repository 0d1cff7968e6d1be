"""The report builds tables from a real (sqlite) MLflow store holding a small synthetic sweep."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from fp8rl.launch.sweep import ensure_parent
from fp8rl.report import tables
from fp8rl.report.__main__ import main
from fp8rl.tracking import store as runs


def _child(client, exp_id: str, parent: str, arm: str, seed: int, entropy: list[float], acc: float) -> str:
    from mlflow.entities import Metric

    tags = {"mlflow.parentRunId": parent, "sweep.arm": arm, "seed": str(seed), "git_sha": "abc123"}
    tags["fp8rl.config_hash"] = f"{arm}-{seed}"  # trainer runs carry their config hash
    run_id = client.create_run(exp_id, tags=tags, run_name=f"{arm}-{seed}").info.run_id
    metrics = [Metric("rollout/entropy", v, 0, i) for i, v in enumerate(entropy)]
    metrics += [Metric("eval/accuracy", acc - 0.1, 0, 0), Metric("eval/accuracy", acc, 0, len(entropy) - 1)]
    metrics += [Metric("clip/low_neg", 0.01 * (seed + 1), 0, i) for i in range(len(entropy))]
    client.log_batch(run_id, metrics=metrics)
    client.log_param(run_id, "algo.lr", "2e-05")
    client.set_terminated(run_id, "FINISHED")
    return run_id


@pytest.fixture
def store(tmp_path: Path) -> str:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = runs.client(uri)
    exp_id = runs.experiment_id(client, "grpo_granularity-tiny", create=True)
    parent = ensure_parent(client, exp_id, "grpo_granularity-tiny", {"fp8rl.axes": "sweep.arm,sweep.trainer.seed"})
    flat, surge = [0.2] * 40, [0.2] * 20 + [0.8] * 20
    for seed in range(3):
        _child(client, exp_id, parent, "bf16", seed, flat, 0.90 + 0.01 * seed)
        _child(client, exp_id, parent, "fp8_tensorwise", seed, surge if seed < 2 else flat, 0.80)
    unfinished = _child(client, exp_id, parent, "bf16", 9, flat, 0.0)
    client.set_terminated(unfinished, "FAILED")
    return uri


def test_table_groups_seeds_reduces_histories_and_sets_the_paper_beside_ours(store: str, tmp_path: Path) -> None:
    out = tmp_path / "results"
    written = tables.write_table("grpo_granularity-tiny", out, tracking_uri=store)
    assert {p.name for p in written} == {
        "grpo_granularity-tiny.md",
        "grpo_granularity-tiny.csv",
        "grpo_granularity-tiny.runs.csv",
        "grpo_granularity-tiny.runs.json",
    }
    rows = {r["arm"]: r for r in csv.DictReader(open(out / "grpo_granularity-tiny.csv"))}
    assert rows["bf16"]["runs"] == "3"  # the FAILED run is left out
    assert float(rows["bf16"]["final eval acc:mean"]) == pytest.approx(0.91)
    assert float(rows["bf16"]["final eval acc:std"]) == pytest.approx(0.01)
    assert float(rows["fp8_tensorwise"]["surged:mean"]) == pytest.approx(2 / 3)
    assert float(rows["bf16"]["surged:mean"]) == 0.0
    assert float(rows["fp8_tensorwise"]["peak entropy:mean"]) == pytest.approx((0.8 + 0.8 + 0.2) / 3)
    assert float(rows["bf16"]["clip/low_neg (mean):mean"]) == pytest.approx(0.02)
    md = (out / "grpo_granularity-tiny.md").read_text()
    assert "| bf16           |      3 | 0.910 ± 0.010 " in md and md.rstrip().endswith("gaps to BF16).")
    assert "57.6" in md and "46.1" in md  # the paper's BF16 and tensorwise scores
    assert "abc123" in md
    per_run = list(csv.DictReader(open(out / "grpo_granularity-tiny.runs.csv")))
    assert len(per_run) == 6 and all(r["run_id"] and r["git_sha"] == "abc123" for r in per_run)
    configs = json.loads((out / "grpo_granularity-tiny.runs.json").read_text())
    assert configs["runs"][0]["config"] == {"algo.lr": "2e-05"}


def test_cli_index_lists_files_and_run_ids(store: str, tmp_path: Path) -> None:
    out = tmp_path / "res"
    assert main(["--tracking-uri", store, "--out", str(out), "table", "grpo_granularity"]) == 0
    assert main(["--tracking-uri", store, "--out", str(out), "index"]) == 0
    prov = json.loads((out / "PROVENANCE.json").read_text())
    assert len(prov["sources"]["grpo_granularity-tiny.runs.json"]["run_ids"]) == 6
    assert "git_sha" in prov["builder"]
    assert "[grpo_granularity-tiny.md](grpo_granularity-tiny.md) | 6 |" in (out / "INDEX.md").read_text()


def test_missing_store_or_experiment_says_what_to_run(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no MLflow store"):
        tables.write_table("grpo_granularity-tiny", tmp_path, tracking_uri=f"sqlite:///{tmp_path / 'none.db'}")
    uri = f"sqlite:///{tmp_path / 'empty.db'}"
    runs.experiment_id(runs.client(uri), "other", create=True)
    with pytest.raises(SystemExit, match="run its sweep first"):
        tables.write_table("dapo_table-tiny", tmp_path, tracking_uri=uri)


def test_figures_from_the_store(store: str, tmp_path: Path) -> None:
    assert main(["--tracking-uri", store, "--out", str(tmp_path), "figures"]) == 0
    assert (tmp_path / "figures" / "grpo_granularity-tiny_curves.png").stat().st_size > 10_000
    assert (tmp_path / "figures" / "grpo_granularity-tiny_curves.pdf").exists()
