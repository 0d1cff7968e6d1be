"""The one table builder of fp8rl: MLflow runs -> a pandas frame (one row per run) -> grouped mean and std.

`fp8rl compare`, the paper tables (`fp8rl.report.tables`) and the demo's summary all build on it:

- `load_runs`: the (finished) training runs of an experiment with the histories of the wanted metrics;
- `runs_frame`: one row per run: its id, name, git SHA, the grouping keys and each `Column` reduced over
  the run's steps (last / mean / max / min, or the entropy-surge detector);
- `grouped`: pandas ``groupby().agg`` over the grouping keys: n, mean and sample std of every column;
- `cells`: "mean ± std" strings for Markdown (``DataFrame.to_markdown``); CSVs come from ``to_csv``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from fp8rl.report.surge import SurgeRule, detect_surge
from fp8rl.tracking import store

REDUCTIONS = ("last", "mean", "max", "min", "surge_ratio", "surged")
FALLBACK_GROUP_BY = ("algo", "precision", "recipe", "clipping")
SURGE_RULE = SurgeRule()


@dataclass(frozen=True)
class Column:
    """One table column: metric `key` of each run reduced over its steps by `reduce`."""

    label: str
    key: str
    reduce: str = "last"
    fmt: str = "{:.3f}"

    def __post_init__(self) -> None:
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"reduction {self.reduce!r}; valid: {list(REDUCTIONS)}")


@dataclass
class RunData:
    run_id: str
    name: str
    group: tuple[str, ...]
    tags: dict[str, str]
    params: dict[str, str]
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # key -> [(step, value)]

    def series(self, key: str) -> list[float]:
        return [v for _, v in sorted(self.history.get(key, []))]


def lookup(run: Any, key: str) -> str:
    """A grouping key's value for a run: a tag, a sweep-axis tag (``sweep.<key>``, ``sweep.<...>.<key>``),
    a param (``clipping.interval``) or a param by its last part (``interval``)."""
    tags, params = run.data.tags, run.data.params
    for value in (tags.get(key), tags.get(f"sweep.{key}"), params.get(key)):
        if value is not None:
            return value
    for mapping, prefix in ((tags, "sweep."), (params, "")):
        found = [v for k, v in mapping.items() if k.startswith(prefix) and k.endswith(f".{key}")]
        if len(found) == 1:
            return found[0]
    return ""


def default_group_by(client: Any, exp_id: str, sweep: str) -> list[str]:
    """The sweep's axes (its parent run's ``fp8rl.axes``) without seeds, else algo/precision/recipe/clipping."""
    parent = store.find_parent(client, exp_id, sweep)
    axes = (parent.data.tags.get("fp8rl.axes", "") if parent else "").split(",")
    axes = [a for a in axes if a and not a.endswith("seed")]
    return axes or list(FALLBACK_GROUP_BY)


def load_runs(
    experiment: str,
    keys: Sequence[str],
    group_by: Sequence[str] | None = None,
    tracking_uri: str | None = None,
    finished_only: bool = True,
) -> tuple[list[RunData], list[str], str]:
    """The training runs of `experiment` (oldest first) with the histories of `keys`: (runs, group_by, uri)."""
    uri = store.absolute_tracking_uri(tracking_uri)
    if not store.store_exists(uri):
        raise SystemExit(f"no MLflow store at {store.display_uri(uri)}: run the sweep first (e.g. make table-grpo)")
    client = store.client(uri)
    exp_id = store.experiment_id(client, experiment, create=False)
    if exp_id is None:
        raise SystemExit(f"no MLflow experiment {experiment!r} in {store.display_uri(uri)}: run its sweep first")
    group_by = list(group_by) if group_by else default_group_by(client, exp_id, experiment)
    out = []
    for run in reversed(store.child_runs(client, exp_id)):
        if finished_only and run.info.status != "FINISHED":
            continue
        data = RunData(
            run.info.run_id,
            run.info.run_name or "",
            tuple(lookup(run, k) for k in group_by),
            dict(run.data.tags),
            dict(run.data.params),
            store.metric_histories(client, run, keys),
        )
        out.append(data)
    return out, group_by, uri


def reduce_values(values: Sequence[float], reduce: str) -> float:
    """One run's steps -> one number (NaN for a metric the run never logged)."""
    if not values:
        return math.nan
    if reduce in ("surge_ratio", "surged"):
        if len(values) < 4:
            return math.nan
        surge = detect_surge(values, SURGE_RULE)
        return surge.ratio if reduce == "surge_ratio" else float(surge.surged)
    series = pd.Series(values, dtype=float)
    return float(series.iloc[-1] if reduce == "last" else getattr(series, reduce)())


def runs_frame(run_data: Sequence[RunData], columns: Sequence[Column], group_by: Sequence[str]) -> pd.DataFrame:
    """One row per run: run_id, run_name, git_sha, the grouping keys, each column's reduced value."""
    rows = []
    for run in run_data:
        row = {"run_id": run.run_id, "run_name": run.name, "git_sha": run.tags.get("git_sha", "")}
        row.update(dict(zip(group_by, run.group, strict=True)))
        row.update({c.label: reduce_values(run.series(c.key), c.reduce) for c in columns})
        rows.append(row)
    return pd.DataFrame(rows, columns=["run_id", "run_name", "git_sha", *group_by, *(c.label for c in columns)])


def grouped(frame: pd.DataFrame, group_by: Sequence[str], columns: Sequence[Column]) -> pd.DataFrame:
    """Per group (in order of first appearance): ``runs`` and ``<label>:mean`` / ``<label>:std`` (sample std,
    0 for a single run; NaN values left out)."""
    labels = [c.label for c in columns]
    by = list(group_by) or [pd.Series("all", index=frame.index, name="group")]
    stats = frame.groupby(by, sort=False, dropna=False)[labels].agg(["mean", "std"])
    stats.columns = [f"{label}:{stat}" for label, stat in stats.columns]
    for label in labels:
        stats[f"{label}:std"] = stats[f"{label}:std"].fillna(0.0).where(stats[f"{label}:mean"].notna())
    counts = frame.groupby(by, sort=False, dropna=False).size().rename("runs")
    return pd.concat([counts, stats], axis=1).reset_index()


def cells(table: pd.DataFrame, group_by: Sequence[str], columns: Sequence[Column]) -> pd.DataFrame:
    """Display strings: the grouping keys, ``runs``, and ``mean ± std`` per column (``-`` where no run has it)."""
    out = table[[*group_by, "runs"]].copy() if group_by else table[["runs"]].copy()
    for column in columns:
        means, stds = table[f"{column.label}:mean"], table[f"{column.label}:std"]
        out[column.label] = [_cell(m, s, n, column.fmt) for m, s, n in zip(means, stds, table["runs"], strict=True)]
    return out


def _cell(mean: float, std: float, n: int, fmt: str) -> str:
    if pd.isna(mean):
        return "-"
    return fmt.format(mean) if n < 2 else f"{fmt.format(mean)} ± {fmt.format(std)}"
