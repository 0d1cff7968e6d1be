"""Did a re-run reproduce? An experiment's runs against the runs of other experiments with the same config hash.

A sweep skips the config hashes that finished in its own MLflow experiment only, so an experiment that shares
arms with another (an ablation beside a table) runs them again. `write_reruns` pairs each finished run of the
experiment with every finished run of the same config hash in the store's other experiments and compares each
metric both logged, step by step (NaN equals NaN: a bit-identical history is identical). Timings, system and
launch metrics are left out: they measure the machine, not the run.

`write_reproduction` compares a table with the same table run again elsewhere (another store, commit or machine),
run by run (same arm and seed), in every per-run column of the two ``*.runs.csv``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from fp8rl.report.frames import Column
from fp8rl.report.tables import read_table_runs
from fp8rl.tracking import store

MACHINE_METRICS = ("time/", "system/", "launch/")


@dataclass(frozen=True)
class HistoryComparison:
    """Two runs' metric histories, compared on the metrics both logged."""

    compared: int  # metrics both runs logged
    identical: int  # of them, equal at every step
    largest_difference: float  # max |a - b| over the shared steps of every compared metric
    first_different: str  # the first differing metric in name order, "" when all are identical


def compare_histories(
    a: Mapping[str, list[tuple[int, float]]], b: Mapping[str, list[tuple[int, float]]]
) -> HistoryComparison:
    """Compare two runs' histories (metric -> [(step, value)]); a metric whose steps differ is not identical."""
    keys = sorted(k for k in set(a) & set(b) if not k.startswith(MACHINE_METRICS))
    identical, largest, first = 0, 0.0, ""
    for key in keys:
        left, right = dict(a[key]), dict(b[key])
        gap = max((_gap(left[s], right[s]) for s in left.keys() & right.keys()), default=0.0)
        largest = max(largest, gap)
        if left.keys() == right.keys() and gap == 0.0:  # _gap is 0 exactly where two values are the same
            identical += 1
        elif not first:
            first = key
    return HistoryComparison(len(keys), identical, largest, first)


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _gap(a: float, b: float) -> float:
    """|a - b|; 0 for two NaNs, infinite for a NaN against a number."""
    if _same(a, b):
        return 0.0
    return math.inf if math.isnan(a) or math.isnan(b) else abs(a - b)


def write_reruns(experiment: str, out_dir: Path, tracking_uri: str | None = None) -> list[Path]:
    """``<experiment>.reruns.md`` / ``.csv``: each finished run of `experiment` that repeats a config hash finished
    in another experiment, with how far its metric histories are from that run's."""
    uri = store.absolute_tracking_uri(tracking_uri)
    client = store.client(uri)
    exp_id = store.experiment_id(client, experiment, create=False)
    if exp_id is None:
        raise SystemExit(f"no MLflow experiment {experiment!r} in {store.display_uri(uri)}: run its sweep first")
    others = {e.experiment_id: e.name for e in client.search_experiments() if e.experiment_id != exp_id}
    rows = []
    for run in (r for r in store.child_runs(client, exp_id) if r.info.status == "FINISHED"):
        same_config = f"tags.`{store.HASH_TAG}` = '{run.data.tags[store.HASH_TAG]}' and attributes.status = 'FINISHED'"
        matches = store.search(client, list(others), same_config) if others else []
        mine = store.metric_histories(client, run, run.data.metrics) if matches else {}
        for other in matches:
            result = compare_histories(mine, store.metric_histories(client, other, other.data.metrics))
            rows.append(_row(run, other, others[other.info.experiment_id], result))
    frame = pd.DataFrame(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    md, csv_path = out_dir / f"{experiment}.reruns.md", out_dir / f"{experiment}.reruns.csv"
    title = (
        f"Re-runs in `{experiment}` (MLflow `{store.display_uri(uri)}`) of config hashes that finished in another "
        f"experiment: {len(frame)} pair(s). Every metric both runs logged is compared step by step "
        f"(not {', '.join(MACHINE_METRICS)}: the machine's); `identical` counts metrics equal at every step."
    )
    table = frame.to_markdown(index=False, floatfmt=".3g") if len(frame) else "(none)"
    md.write_text(f"{title}\n\n{table}\n")
    frame.to_csv(csv_path, index=False)
    return [md, csv_path]


def _row(run, other, other_experiment: str, result: HistoryComparison) -> dict[str, object]:
    return {
        "run": run.info.run_name,
        "config hash": run.data.tags[store.HASH_TAG],
        "run id": run.info.run_id,
        "git": run.data.tags.get("git_sha", "")[:10],
        "other run": f"{other_experiment}: {other.info.run_id}",
        "other git": other.data.tags.get("git_sha", "")[:10],
        "metrics compared": result.compared,
        "identical": result.identical,
        "largest abs difference": result.largest_difference,
        "first differing metric": result.first_different or "-",
    }


def write_reproduction(stem: str, columns: list[Column], published: Path, again: Path, out_dir: Path) -> list[Path]:
    """``<stem>.reproduction.md`` / ``.csv``: each run of the table in `published` against the run of the same group
    and seed in `again` (the table's files written by another run of its sweep), in every column of `columns`: how
    many hold the same float (NaN equals NaN, -0.0 does not equal 0.0: bit for bit, as written) and the largest
    absolute difference. A published run without a counterpart is ``missing``; runs only `again` has are counted."""
    mine, theirs = read_table_runs(published, stem, columns), read_table_runs(again, stem, columns)
    if theirs.names != mine.names:
        raise SystemExit(f"{stem}: the two tables group their runs by {mine.names} and {theirs.names}")
    keys = [*mine.names, *(["seed"] if "seed" in mine.per_run.columns else [])]
    for frame, where in ((mine.per_run, published), (theirs.per_run, again)):
        if frame.duplicated(keys).any():
            raise SystemExit(f"{where / stem}.runs.csv holds several runs of one {', '.join(keys)}")
    other = theirs.per_run.set_index(keys)
    rows = [_reproduction_row(run, other, keys, columns) for _, run in mine.per_run.iterrows()]
    frame = pd.DataFrame(rows)
    published_keys = set(mine.per_run[keys].itertuples(index=False, name=None))
    extra = sum(key not in published_keys for key in theirs.per_run[keys].itertuples(index=False, name=None))
    out_dir.mkdir(parents=True, exist_ok=True)
    md, csv_path = out_dir / f"{stem}.reproduction.md", out_dir / f"{stem}.reproduction.csv"
    md.write_text(f"{_reproduction_title(stem, frame, keys, len(columns), extra)}\n\n"
                  f"{frame.to_markdown(index=False, floatfmt='.3g')}\n")  # fmt: skip
    frame.to_csv(csv_path, index=False)
    return [md, csv_path]


def _reproduction_row(run: pd.Series, other: pd.DataFrame, keys: list[str], columns: list[Column]) -> dict:
    key = tuple(run[k] for k in keys) if len(keys) > 1 else run[keys[0]]
    match = other.loc[key] if key in other.index else None
    gaps = [] if match is None else [_bitwise_gap(run[c.label], match[c.label]) for c in columns]
    return {
        **{k: run[k] for k in keys},
        "status": "missing" if match is None else "equal" if not any(gaps) else "different",
        "run_id": run["run_id"],
        "git": run.get("git_sha", "")[:10],
        "again_run_id": "" if match is None else match["run_id"],
        "again_git": "" if match is None else match.get("git_sha", "")[:10],
        "columns_equal": sum(g == 0.0 for g in gaps),
        "columns": len(gaps),
        "largest_abs_difference": max(gaps, default=math.nan),
        "differing_columns": " ".join(c.name for c, g in zip(columns, gaps, strict=False) if g),
    }


def _bitwise_gap(a: float, b: float) -> float:
    """`_gap`, but 0.0 against -0.0 counts as different (the smallest float, for a count of differing columns)."""
    gap = _gap(a, b)
    if gap == 0.0 and not math.isnan(a) and math.copysign(1.0, a) != math.copysign(1.0, b):
        return 5e-324
    return gap


def _reproduction_title(stem: str, frame: pd.DataFrame, keys: list[str], n_columns: int, extra: int) -> str:
    equal = int((frame["status"] == "equal").sum())
    missing = int((frame["status"] == "missing").sum())
    again = sorted({g for g in frame["again_git"] if g}) or ["-"]
    return (
        f"Table `{stem}` run again: {equal} of {len(frame)} published run(s) give the published values in all "
        f"{n_columns} per-run columns, bit for bit; {missing} have no run in the other table, which has {extra} run(s) "
        f"the published table lacks (runs matched by {', '.join(keys)}; published runs at git "
        f"{', '.join(sorted(set(frame['git'])))}, again at git {', '.join(again)})."
    )
