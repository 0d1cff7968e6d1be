"""The report builds tables from a real (sqlite) MLflow store holding a small synthetic sweep."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pandas as pd
import pytest

from fp8rl.launch.parent import ensure_parent
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
    metrics += [Metric("clip/calib_ok", 1.0, 0, i) for i in (5, 10)]
    client.log_batch(run_id, metrics=metrics)
    client.log_param(run_id, "algo.lr", "2e-05")
    client.log_param(run_id, "trainer.seed", str(seed))
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
        "grpo_granularity-tiny.paired.csv",
        "grpo_granularity-tiny.runs.csv",
        "grpo_granularity-tiny.runs.json",
    }
    rows = {(r["arm"], r["metric"]): r for r in csv.DictReader(open(out / "grpo_granularity-tiny.csv"))}
    assert rows["bf16", "acc_last_3_evals"]["n"] == "3"  # the FAILED run is left out
    assert float(rows["bf16", "acc_last_3_evals"]["mean"]) == pytest.approx(0.91 - 0.05)  # mean of its 2 evals
    assert float(rows["bf16", "acc_last_3_evals"]["std"]) == pytest.approx(0.01)
    assert float(rows["bf16", "calib_ok"]["mean"]) == 2.0  # calibrations counted over the run
    assert float(rows["fp8_tensorwise", "surged"]["mean"]) == pytest.approx(2 / 3)
    assert float(rows["bf16", "surged"]["mean"]) == 0.0
    assert float(rows["fp8_tensorwise", "peak_entropy"]["mean"]) == pytest.approx((0.8 + 0.8 + 0.2) / 3)
    assert float(rows["bf16", "clip_low_neg_mean"]["mean"]) == pytest.approx(0.02)
    assert rows["bf16", "overclip_cc_out_of_sample"]["n"] == "0"  # never logged by these runs
    md = (out / "grpo_granularity-tiny.md").read_text()
    assert "| bf16           |      3 |    57.6 | 0.860 ± 0.010 " in md  # the key columns first, the paper's beside
    assert "<details><summary>all 21 columns</summary>" in md
    assert "Per-seed paired differences against `bf16`" in md
    assert "57.6" in md and "46.1" in md  # the paper's BF16 and tensorwise scores
    assert "abc123" in md
    per_run = list(csv.DictReader(open(out / "grpo_granularity-tiny.runs.csv")))
    assert len(per_run) == 6 and all(r["run_id"] and r["git_sha"] == "abc123" for r in per_run)
    assert sorted(r["seed"] for r in per_run) == ["0", "0", "1", "1", "2", "2"]
    configs = json.loads((out / "grpo_granularity-tiny.runs.json").read_text())
    assert configs["runs"][0]["config"] == {"algo.lr": "2e-05", "trainer.seed": "0"}


def test_a_re_run_of_an_arm_and_seed_supersedes_the_older_run(store: str, tmp_path: Path) -> None:
    client = runs.client(store)
    exp_id = runs.experiment_id(client, "grpo_granularity-tiny", create=False)
    parent = ensure_parent(client, exp_id, "grpo_granularity-tiny", {})
    _child(client, exp_id, parent, "bf16", 0, [0.2] * 40, 0.50)  # re-run of bf16 seed 0 (e.g. new code)
    out = tmp_path / "results"
    tables.write_table("grpo_granularity-tiny", out, tracking_uri=store)
    per_run = [r for r in csv.DictReader(open(out / "grpo_granularity-tiny.runs.csv")) if r["arm"] == "bf16"]
    assert sorted(r["seed"] for r in per_run) == ["0", "1", "2"]
    assert [float(r["acc_last_3_evals"]) for r in per_run if r["seed"] == "0"] == [pytest.approx(0.45)]
    assert (
        "1 older run(s) of the same arm and seed, superseded by a re-run"
        in (out / "grpo_granularity-tiny.md").read_text()
    )


def test_paired_differences_against_bf16_with_t_intervals(store: str, tmp_path: Path) -> None:
    tables.write_table("grpo_granularity-tiny", tmp_path, tracking_uri=store)
    paired = {r["metric"]: r for r in csv.DictReader(open(tmp_path / "grpo_granularity-tiny.paired.csv"))}
    acc = paired["acc_last_3_evals"]
    # fp8 0.80 - 0.05 in every seed vs bf16 0.90/0.91/0.92 - 0.05: differences -0.10, -0.11, -0.12
    assert (acc["arm"], acc["n"]) == ("fp8_tensorwise", "3")
    assert float(acc["mean"]) == pytest.approx(-0.11)
    half = 4.302652729911275 * 0.01 / 3**0.5  # t(0.975, 2) * sd / sqrt(n)
    assert (float(acc["ci_low"]), float(acc["ci_high"])) == (pytest.approx(-0.11 - half), pytest.approx(-0.11 + half))
    low_neg = paired["clip_low_neg_mean"]  # identical per seed in both arms: a zero-width interval at 0
    assert float(low_neg["mean"]) == 0 and float(low_neg["ci_low"]) == float(low_neg["ci_high"]) == 0
    md = (tmp_path / "grpo_granularity-tiny.md").read_text()
    assert "| fp8_tensorwise | bf16      |   3 | -0.110 [-0.135, -0.085]" in md


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


def test_a_window_is_paired_only_where_both_runs_have_the_same_steps() -> None:
    import math

    import pandas as pd

    from fp8rl.report.frames import Column, RunData

    schedules = {"bf16": "None", "cc": "None", "cc_first0": "0"}
    run_data = [
        RunData(arm, arm, (arm,), {}, {"clipping.interval": "5", "clipping.first_step": first}, {})
        for arm, first in schedules.items()
    ]
    columns = [
        Column("after", "clip/low_neg", "mean_calibrated_bounds"),
        Column("late", "clip/low_neg", "mean_steps_from_k2"),
    ]
    per_run = pd.DataFrame({"run_id": list(schedules), "seed": "0", "arm": list(schedules), "after": 1.0, "late": 1.0})
    kept = tables._unpaired_windows_left_out(per_run, "arm", columns, run_data).set_index("arm")
    assert math.isnan(kept.at["cc_first0", "after"])  # steps 2-40 against BF16's 7-40: not a pair
    assert kept.at["cc", "after"] == 1.0 and (kept["late"] == 1.0).all()  # the same steps


def _arm_run(client, exp_id: str, parent: str, arm: str, seed: int, low_neg: float, policy: str, mode: str) -> None:
    from mlflow.entities import Metric, Param

    tags = {"mlflow.parentRunId": parent, "sweep.arm": arm, "fp8rl.config_hash": f"{arm}-{seed}"}
    run_id = client.create_run(exp_id, tags=tags, run_name=f"{arm}-{seed}").info.run_id
    metrics = [Metric("clip/low_neg", low_neg + 0.001 * seed * (arm == "cc_tensorwise"), 0, i) for i in range(12)]
    params = {"trainer.seed": seed, "clipping.policy": policy, "clipping.interval": 5, "precision.mode": mode}
    params["precision.recipe"] = arm.split("_")[-1]  # bf16 for the BF16 arm: a recipe no other arm has
    client.log_batch(run_id, metrics=metrics, params=[Param(k, str(v)) for k, v in params.items()])
    client.set_terminated(run_id, "FINISHED")


def _table_of(tmp_path: Path, arms: dict[str, tuple[float, str, str]]) -> tuple[list[dict[str, str]], str]:
    """The paired rows and the markdown of a 3-seed table of `arms` (arm: clip/low_neg, policy, precision mode)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = runs.client(uri)
    exp_id = runs.experiment_id(client, "grpo_granularity-tiny", create=True)
    parent = ensure_parent(client, exp_id, "grpo_granularity-tiny", {"fp8rl.axes": "sweep.arm"})
    for seed in range(3):
        for arm, (low_neg, policy, mode) in arms.items():
            _arm_run(client, exp_id, parent, arm, seed, low_neg, policy, mode)
    tables.write_table("grpo_granularity-tiny", tmp_path, tracking_uri=uri)
    paired = list(csv.DictReader(open(tmp_path / "grpo_granularity-tiny.paired.csv")))
    return paired, (tmp_path / "grpo_granularity-tiny.md").read_text()


def test_calibrated_clipping_is_paired_with_vanilla_fp8_of_the_same_precision(tmp_path: Path) -> None:
    paired, md = _table_of(
        tmp_path,
        {
            "bf16": (0.01, "standard", "bf16"),
            "fp8_tensorwise": (0.05, "standard", "fp8_full"),
            "fp8_rowwise": (0.03, "standard", "fp8_full"),
            "cc_tensorwise": (0.021, "calibrated", "fp8_full"),
            "cc_blockwise": (0.02, "calibrated", "fp8_full"),  # no vanilla blockwise arm here: not paired
        },
    )
    against = {(r["arm"], r["against"]) for r in paired}
    assert ("cc_tensorwise", "fp8_tensorwise") in against and ("cc_tensorwise", "bf16") in against
    assert {a for a, ref in against if ref != "bf16"} == {"cc_tensorwise"}  # cc_blockwise only against BF16
    whole_run = {(r["arm"], r["against"]): float(r["mean"]) for r in paired if r["metric"] == "clip_low_neg_mean"}
    assert whole_run["cc_tensorwise", "fp8_tensorwise"] == pytest.approx(0.022 - 0.05)  # CC seeds: 0.021-0.023
    assert "against the vanilla FP8 arm with the same precision" in md
    row = next(line for line in md.splitlines() if line.startswith("| cc_tensorwise | fp8_tensorwise"))
    assert "70%" in row  # 1 - (0.022 - 0.01) / (0.05 - 0.01): the share of vanilla's excess removed


def test_no_excess_share_without_an_excess_or_without_bf16(tmp_path: Path) -> None:
    arms = {
        "bf16": (0.05, "standard", "bf16"),
        "fp8_tensorwise": (0.04, "standard", "fp8_full"),  # below BF16: no excess to remove
        "cc_tensorwise": (0.02, "calibrated", "fp8_full"),
    }
    _, md = _table_of(tmp_path / "below", arms)
    row = next(line for line in md.splitlines() if line.startswith("| cc_tensorwise | fp8_tensorwise"))
    assert row.rstrip(" |").endswith("-")
    del arms["bf16"]
    paired, md = _table_of(tmp_path / "no_bf16", arms)
    assert {(r["arm"], r["against"]) for r in paired} == {("cc_tensorwise", "fp8_tensorwise")}
    assert "excess removed" not in md


def test_the_share_of_excess_removed_carries_a_bootstrap_interval_over_seeds() -> None:
    """Issue 30's audit: "80% / 75% / 59% removed" were point estimates from 10 seeds; the table now gives a paired
    percentile bootstrap interval (seeds resampled together across the three arms)."""
    import numpy as np

    from fp8rl.report.tables import _share_removed_cell

    steady = pd.DataFrame({"cc": [0.022] * 5, "van": [0.05] * 5, "bf16": [0.01] * 5})
    assert _share_removed_cell(steady, "cc", "van") == "70% [70%, 70%]"  # no seed-to-seed spread: no width
    rng = np.random.default_rng(1)
    noisy = pd.DataFrame(
        {"cc": 0.022 + rng.normal(0, 0.004, 10), "van": 0.05 + rng.normal(0, 0.004, 10), "bf16": [0.01] * 10}
    )
    share, low, high = (float(x) / 100 for x in re.findall(r"(-?\d+)%", _share_removed_cell(noisy, "cc", "van")))
    assert low < share < high and high - low > 0.05
    assert _share_removed_cell(noisy.iloc[:2], "cc", "van").count("%") == 1  # two seeds: the estimate alone


def _without_header(text: str) -> list[str]:
    return text.splitlines()[1:]  # the first line says where the values came from and when


def test_a_table_re_rendered_from_its_own_files_equals_the_one_built_from_mlflow(store: str, tmp_path: Path) -> None:
    built, rebuilt = tmp_path / "built", tmp_path / "rebuilt"
    tables.write_table("grpo_granularity-tiny", built, tracking_uri=store)
    rebuilt.mkdir()
    for suffix in (".runs.csv", ".runs.json"):
        (rebuilt / f"grpo_granularity-tiny{suffix}").write_bytes(
            (built / f"grpo_granularity-tiny{suffix}").read_bytes()
        )
    assert main(["--out", str(rebuilt), "rebuild"]) == 0  # no store: every table found in the folder
    for name in ("grpo_granularity-tiny.csv", "grpo_granularity-tiny.paired.csv", "grpo_granularity-tiny.runs.csv",
                 "grpo_granularity-tiny.runs.json"):  # fmt: skip
        assert (rebuilt / name).read_bytes() == (built / name).read_bytes(), name
    md = (rebuilt / "grpo_granularity-tiny.md").read_text()
    assert _without_header(md) == _without_header((built / "grpo_granularity-tiny.md").read_text())
    assert "kept in `grpo_granularity-tiny.runs.csv`" in md.splitlines()[0]


def test_a_per_run_file_written_with_labels_before_the_names_re_renders_the_same(store: str, tmp_path: Path) -> None:
    """The published tables' runs.csv files (2026-12-04) name their columns by label; their store is gone."""
    tables.write_table("grpo_granularity-tiny", tmp_path, tracking_uri=store)
    before = {p.name: p.read_bytes() for p in tmp_path.glob("grpo_granularity-tiny.*")}
    per_run = pd.read_csv(tmp_path / "grpo_granularity-tiny.runs.csv", dtype=str, keep_default_na=False)
    per_run.rename(columns={c.name: c.label for c in tables.TABLE_COLUMNS}).to_csv(
        tmp_path / "grpo_granularity-tiny.runs.csv", index=False
    )
    tables.rebuild_table("grpo_granularity-tiny", tmp_path)
    after = {p.name: p.read_bytes() for p in tmp_path.glob("grpo_granularity-tiny.*")}
    assert [n for n in before if before[n] != after[n]] == ["grpo_granularity-tiny.md"]  # the header's date only
    assert _without_header(after["grpo_granularity-tiny.md"].decode()) == _without_header(
        before["grpo_granularity-tiny.md"].decode()
    )


def test_re_rendering_without_the_files_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="per-run files are written by"):
        tables.rebuild_table("grpo_granularity-tiny", tmp_path)
    with pytest.raises(SystemExit, match="no table's"):
        main(["--out", str(tmp_path), "rebuild"])
    with pytest.raises(SystemExit, match="unknown table"):
        main(["--out", str(tmp_path), "rebuild", "grpo"])


def test_every_column_has_a_distinct_identifier_and_a_definition_in_the_index(store: str, tmp_path: Path) -> None:
    from fp8rl.report.__main__ import TABLE_EXPERIMENTS
    from fp8rl.report.frames import tidy_name

    assert tidy_name("acc, BF16 eval (last 3)") == "acc_bf16_eval_last_3"
    assert tidy_name("step A<0 tokens") == "step_neg_tokens"
    assert tidy_name("clip/low_neg, steps K + 2 on") == "clip_low_neg_steps_k_plus_2_on"
    assert set(tables.KEY_LABELS) <= {c.label for c in tables.TABLE_COLUMNS}
    named: dict = {}
    for experiment in TABLE_EXPERIMENTS:
        columns = tables.columns_of(experiment)
        names = [c.name for c in columns]
        assert len(set(names)) == len(names), experiment
        assert all(re.fullmatch(r"[a-z0-9_]+", n) for n in names)
        for column in columns:  # one name means one column in every table
            assert named.setdefault(column.name, column) == column, column.name
        assert set(tables.key_labels(experiment, columns)) >= set(tables.EXTRA_KEY_LABELS.get(experiment, ()))
    main(["--tracking-uri", store, "--out", str(tmp_path), "table", "grpo_granularity"])
    main(["--tracking-uri", store, "--out", str(tmp_path), "index"])
    index = (tmp_path / "INDEX.md").read_text()
    assert "## Columns" in index
    row = next(line for line in index.splitlines() if line.startswith("| `clip_low_neg_after_1st_calibration`"))
    assert [cell.strip() for cell in row.strip("|").split("|")] == [
        "`clip_low_neg_after_1st_calibration`",
        "clip/low_neg after 1st calibration",
        "`clip/low_neg`: the mean over the steps after the first calibration",
    ]


def test_a_table_run_again_is_compared_run_by_run_in_every_column(store: str, tmp_path: Path) -> None:
    published, again = tmp_path / "published", tmp_path / "again"
    tables.write_table("grpo_granularity-tiny", published, tracking_uri=store)
    tables.write_table("grpo_granularity-tiny", again, tracking_uri=store)
    per_run = pd.read_csv(again / "grpo_granularity-tiny.runs.csv", dtype=str, keep_default_na=False)
    per_run.loc[0, "peak_entropy"] = repr(float(per_run.loc[0, "peak_entropy"]) + 2.0**-40)  # one run, one column
    per_run.loc[1, "surged"] = "-0.0"  # 0.0 in the published run: equal as numbers, not bit for bit
    moved = per_run.loc[2, "seed"]
    per_run.loc[2, "seed"] = "7"  # the published run of that seed has no counterpart; seed 7 is extra
    per_run.to_csv(again / "grpo_granularity-tiny.runs.csv", index=False)
    assert main(["--out", str(published), "reproduction", "grpo_granularity", "--again", str(again)]) == 0
    md = (published / "grpo_granularity-tiny.reproduction.md").read_text()
    assert md.startswith(
        "Table `grpo_granularity-tiny` run again: 3 of 6 published run(s) give the published values in all 21 per-run "
        "columns, bit for bit; 1 have no run in the other table, which has 1 run(s) the published table lacks"
    )
    rows = {
        (r["arm"], r["seed"]): r for r in csv.DictReader(open(published / "grpo_granularity-tiny.reproduction.csv"))
    }
    first, second = (rows[per_run.loc[i, "arm"], per_run.loc[i, "seed"]] for i in (0, 1))
    assert (first["status"], first["columns_equal"], first["differing_columns"]) == ("different", "20", "peak_entropy")
    assert float(first["largest_abs_difference"]) == pytest.approx(2.0**-40, rel=0.01)
    assert (second["status"], second["differing_columns"]) == ("different", "surged")
    assert rows[per_run.loc[2, "arm"], moved]["status"] == "missing"


def test_a_table_run_again_with_two_runs_of_one_arm_and_seed_is_refused(store: str, tmp_path: Path) -> None:
    published, again = tmp_path / "published", tmp_path / "again"
    tables.write_table("grpo_granularity-tiny", published, tracking_uri=store)
    tables.write_table("grpo_granularity-tiny", again, tracking_uri=store)
    per_run = pd.read_csv(again / "grpo_granularity-tiny.runs.csv", dtype=str, keep_default_na=False)
    pd.concat([per_run, per_run.iloc[:1]]).to_csv(again / "grpo_granularity-tiny.runs.csv", index=False)
    with pytest.raises(SystemExit, match="several runs of one arm, seed"):
        main(["--out", str(published), "reproduction", "grpo_granularity", "--again", str(again)])


def test_a_per_run_file_with_a_column_added_or_removed_since_still_re_renders(store: str, tmp_path: Path) -> None:
    tables.write_table("grpo_granularity-tiny", tmp_path, tracking_uri=store)
    assert json.loads((tmp_path / "grpo_granularity-tiny.runs.json").read_text())["group_by"] == ["arm"]
    per_run = pd.read_csv(tmp_path / "grpo_granularity-tiny.runs.csv", dtype=str, keep_default_na=False)
    per_run = per_run.drop(columns="reward_mean").assign(old_metric="1.0")  # a column added, one removed since
    per_run.to_csv(tmp_path / "grpo_granularity-tiny.runs.csv", index=False)
    tables.rebuild_table("grpo_granularity-tiny", tmp_path)
    md = (tmp_path / "grpo_granularity-tiny.md").read_text()
    assert "have no values here (`-`): ['reward_mean']" in md.splitlines()[0]
    assert "| bf16           |      3 |    57.6 |" in md and "old_metric" not in md  # still grouped by arm alone
    assert "Per-seed paired differences against `bf16`" in md
    rewritten = pd.read_csv(tmp_path / "grpo_granularity-tiny.runs.csv")
    assert "old_metric" not in rewritten and rewritten["reward_mean"].isna().all()


def test_a_group_of_one_run_has_no_std_in_the_csv(tmp_path: Path) -> None:
    from fp8rl.report.frames import Column, RunData, grouped, runs_frame, tidy_stats

    column = Column("a", "a")
    run_data = [RunData(f"r{i}", "", (arm,), {}, {}, {"a": [(0, float(i))]}) for i, arm in enumerate("xyy")]
    stats = tidy_stats(grouped(runs_frame(run_data, [column], ["arm"]), ["arm"], [column]), ["arm"], [column])
    assert stats["n"].tolist() == [1, 2] and pd.isna(stats["std"].iloc[0]) and stats["std"].iloc[1] > 0
