"""``fp8rl compare``: a table of chosen metrics across the runs of a sweep, read back from MLflow.

Each metric is reduced per run (``last``, ``mean``, ``max`` or ``min`` over its logged steps), then
runs are grouped by the sweep axes (default: the parent run's ``fp8rl.axes`` without seeds) and each
group gets mean and std over its runs (seeds). Prints a rich table and writes ``<name>.md``,
``<name>.csv`` (grouped) and ``<name>.runs.csv`` (one row per run, with its MLflow run id).
"""

from __future__ import annotations

import csv
import math
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8rl.launch import runs

AGGREGATIONS = ("last", "mean", "max", "min")
DEFAULT_METRICS = (
    "eval/accuracy:last",
    "rollout/reward:mean",
    "rollout/entropy:max",
    "clip/low_neg:mean",
    "rollout/token_mult_prob_error:mean",
    "time/step:mean",
)
FALLBACK_GROUP_BY = ("algo", "precision", "recipe", "clipping")


@dataclass(frozen=True)
class MetricSpec:
    key: str  # MLflow metric key, e.g. "eval/accuracy"
    agg: str  # how one run's steps reduce to a number: last, mean, max, min

    @property
    def label(self) -> str:
        return f"{self.key} ({self.agg})"


@dataclass
class RunRow:
    run_id: str
    name: str
    group: tuple[str, ...]
    values: dict[MetricSpec, float] = field(default_factory=dict)


@dataclass
class GroupRow:
    group: tuple[str, ...]
    n: int
    mean: dict[MetricSpec, float]
    std: dict[MetricSpec, float]


def parse_metrics(text: str | Sequence[str] | None) -> list[MetricSpec]:
    """``"eval/accuracy,rollout/entropy:max"`` -> specs (aggregation defaults to ``last``)."""
    items = DEFAULT_METRICS if not text else (text.split(",") if isinstance(text, str) else text)
    specs = []
    for item in (i.strip() for i in items if i.strip()):
        key, _, agg = item.rpartition(":") if item.rsplit(":", 1)[-1] in AGGREGATIONS else (item, "", "last")
        specs.append(MetricSpec(key, agg))
    return specs


def reduce(values: Sequence[float], agg: str) -> float:
    if not values:
        return math.nan
    return {"last": lambda v: v[-1], "mean": statistics.fmean, "max": max, "min": min}[agg](values)


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


def default_group_by(mlflow_client: Any, exp_id: str, sweep: str) -> list[str]:
    parent = runs.find_parent(mlflow_client, exp_id, sweep)
    axes = (parent.data.tags.get("fp8rl.axes", "") if parent else "").split(",")
    axes = [a for a in axes if a and not a.endswith("seed")]
    return axes or list(FALLBACK_GROUP_BY)


def run_rows(
    mlflow_client: Any, exp_id: str, specs: list[MetricSpec], group_by: list[str], finished_only: bool = True
) -> list[RunRow]:
    rows = []
    for run in reversed(runs.child_runs(mlflow_client, exp_id)):  # oldest first: stable order
        if finished_only and run.info.status != "FINISHED":
            continue
        row = RunRow(run.info.run_id, run.info.run_name or "", tuple(lookup(run, k) for k in group_by))
        for spec in specs:
            row.values[spec] = _metric(mlflow_client, run, spec)
        rows.append(row)
    return rows


def _metric(mlflow_client: Any, run: Any, spec: MetricSpec) -> float:
    if spec.key not in run.data.metrics:
        return math.nan
    if spec.agg == "last":
        return float(run.data.metrics[spec.key])  # MLflow keeps the value of the highest step
    history = sorted(mlflow_client.get_metric_history(run.info.run_id, spec.key), key=lambda m: (m.step, m.timestamp))
    return reduce([m.value for m in history], spec.agg)


def mean_and_std(values: Iterable[float]) -> tuple[float, float]:
    """Mean and sample std of the non-NaN values (std 0 for one value; both NaN for none)."""
    kept = [v for v in values if not math.isnan(v)]
    if not kept:
        return math.nan, math.nan
    return statistics.fmean(kept), statistics.stdev(kept) if len(kept) > 1 else 0.0


def aggregate(rows: list[RunRow], specs: list[MetricSpec]) -> list[GroupRow]:
    """Mean and sample std over the runs of each group (seeds); NaN values are left out."""
    groups: dict[tuple[str, ...], list[RunRow]] = {}
    for row in rows:
        groups.setdefault(row.group, []).append(row)
    out = []
    for group, members in groups.items():
        mean, std = {}, {}
        for spec in specs:
            mean[spec], std[spec] = mean_and_std(m.values[spec] for m in members)
        out.append(GroupRow(group, len(members), mean, std))
    return out


def _fmt(mean: float, std: float, n: int) -> str:
    if math.isnan(mean):
        return "-"
    return f"{mean:.4g}" if n < 2 else f"{mean:.4g} ± {std:.2g}"


def markdown(groups: list[GroupRow], group_by: list[str], specs: list[MetricSpec], header: str) -> str:
    columns = [*group_by, "runs", *(s.label for s in specs)]
    lines = [header, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for g in groups:
        cells = [*g.group, str(g.n), *(_fmt(g.mean[s], g.std[s], g.n) for s in specs)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_outputs(
    out_dir: Path,
    name: str,
    groups: list[GroupRow],
    rows: list[RunRow],
    group_by: list[str],
    specs: list[MetricSpec],
    header: str,
) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    md, grouped, per_run = out_dir / f"{stem}.md", out_dir / f"{stem}.csv", out_dir / f"{stem}.runs.csv"
    md.write_text(markdown(groups, group_by, specs, header))
    with open(grouped, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow([*group_by, "runs", *(f"{s.key}:{s.agg}:{stat}" for s in specs for stat in ("mean", "std"))])
        for g in groups:
            writer.writerow([*g.group, g.n, *(v for s in specs for v in (g.mean[s], g.std[s]))])
    with open(per_run, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["run_id", "run_name", *group_by, *(f"{s.key}:{s.agg}" for s in specs)])
        for r in rows:
            writer.writerow([r.run_id, r.name, *r.group, *(r.values[s] for s in specs)])
    return [md, grouped, per_run]


def compare(
    experiment: str,
    metrics: str | Sequence[str] | None = None,
    group_by: Sequence[str] | None = None,
    out_dir: Path | None = None,
    tracking_uri: str | None = None,
    include_unfinished: bool = False,
    console: Any | None = None,
) -> tuple[list[GroupRow], list[Path]]:
    """Read the sweep's runs from MLflow, print the grouped table, write .md/.csv when `out_dir` is given."""
    uri = runs.absolute_tracking_uri(tracking_uri)
    if not runs.store_exists(uri):
        raise SystemExit(f"no MLflow store at {uri}")
    mlflow_client = runs.client(uri)
    exp_id = runs.experiment_id(mlflow_client, experiment, create=False)
    if exp_id is None:
        raise SystemExit(f"no MLflow experiment named {experiment!r} in {uri}")
    specs = parse_metrics(metrics)
    keys = list(group_by) if group_by else default_group_by(mlflow_client, exp_id, experiment)
    rows = run_rows(mlflow_client, exp_id, specs, keys, finished_only=not include_unfinished)
    groups = aggregate(rows, specs)
    header = (
        f"Sweep `{experiment}`: {len(rows)} run(s) from MLflow {uri}, grouped by {', '.join(keys)}; "
        f"mean ± std over runs in a group. Generated by `fp8rl compare` on {time.strftime('%Y-%m-%d %H:%M')}."
    )
    _print(groups, keys, specs, header, console)
    paths = write_outputs(out_dir, experiment, groups, rows, keys, specs, header) if out_dir else []
    return groups, paths


def _print(groups: list[GroupRow], keys: list[str], specs: list[MetricSpec], title: str, console: Any) -> None:
    from rich.table import Table

    table = Table(title=title)
    for column in [*keys, "runs", *(s.label for s in specs)]:
        table.add_column(column)
    for g in groups:
        table.add_row(*g.group, str(g.n), *(_fmt(g.mean[s], g.std[s], g.n) for s in specs))
    (console or runs.wide_console()).print(table)
