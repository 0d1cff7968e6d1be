"""The one table builder of fp8rl: MLflow runs -> a pandas frame (one row per run) -> grouped mean and std.

`fp8rl compare`, the paper tables (`fp8rl.report.tables`) and the demo's summary all build on it:

- `load_runs`: the (finished) training runs of an experiment with the histories of the wanted metrics;
- `runs_frame`: one row per run: its id, name, git SHA, the grouping keys and each `Column` reduced over
  the run's steps (last / mean / max / min, or the entropy-surge detector);
- `grouped`: pandas ``groupby().agg`` over the grouping keys: n, mean and sample std of every column;
- `cells`: "mean ± std" strings for Markdown (``DataFrame.to_markdown``);
- `tidy_runs` / `tidy_stats`: the CSVs, with identifier column names (`tidy_name`): one row per run, and one row
  per group and metric (n, mean, std);
- `paired_differences`: per arm, the per-seed differences against a reference arm of the same seed (BF16),
  their mean and a 95% t-interval over seeds (with n), which is the test the tables report, not seed spread.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
from scipy import stats

from fp8rl.report.surge import SurgeRule, detect_surge
from fp8rl.tracking import store

REDUCTIONS = ("first", "last", "last3", "mean", "sum", "max", "min", "surge_ratio", "surged")
# Means over a window of logged steps that each run's calibration schedule gives (`schedule_windows`).
SCHEDULE_WINDOWS = ("mean_initial_bounds", "mean_calibrated_bounds", "mean_steps_2_to_k1", "mean_steps_from_k2")
SEED_KEYS = ("trainer.seed", "sweep.trainer.seed", "seed")  # where a run's seed is found (param or tag)
CONFIDENCE = 0.95
FALLBACK_GROUP_BY = ("algo", "precision", "recipe", "clipping")
SURGE_RULE = SurgeRule()
REDUCTION_TEXT = {  # what each reduction does to one run's logged values, for the tables' codebook
    "first": "the first value",
    "last": "the last value",
    "last3": "the mean of the last 3 values (evaluations)",
    "mean": "the mean over the logged steps",
    "sum": "the sum over the logged steps",
    "max": "the largest value",
    "min": "the smallest value",
    "surge_ratio": "the entropy-surge detector's ratio (fp8rl/report/surge.py)",
    "surged": "1 if the entropy-surge detector fired, else 0",
    "mean_initial_bounds": "the mean over the steps at the initial clip bounds (the run's calibration schedule)",
    "mean_calibrated_bounds": "the mean over the steps after the first calibration",
    "mean_steps_2_to_k1": "the mean over logged steps 2 to K + 1",
    "mean_steps_from_k2": "the mean over logged steps K + 2 on",
}


def tidy_name(label: str) -> str:
    """A column label as an identifier for CSVs and code: ``"acc, BF16 eval (last 3)"`` -> ``acc_bf16_eval_last_3``,
    ``"step A<0 tokens"`` -> ``step_neg_tokens`` (lower case, words joined by ``_``, no commas or brackets)."""
    text = label.replace("A<0", "neg").replace("A>0", "pos").replace("+", " plus ")
    return re.sub(r"[^0-9a-z]+", "_", text.lower()).strip("_")


@dataclass(frozen=True)
class Column:
    """One table column: metric `key` of each run reduced over its steps by `reduce`, or its mean over a
    `SCHEDULE_WINDOWS` window; ``lag`` = 1 reads each step's value from the step before (a clip bound a step logs
    is the one in force from the next step on)."""

    label: str
    key: str
    reduce: str = "last"
    fmt: str = "{:.3f}"
    lag: int = 0

    def __post_init__(self) -> None:
        if self.reduce not in (*REDUCTIONS, *SCHEDULE_WINDOWS):
            raise ValueError(f"reduction {self.reduce!r}; valid: {[*REDUCTIONS, *SCHEDULE_WINDOWS]}")
        if self.lag and self.reduce not in SCHEDULE_WINDOWS:
            raise ValueError(f"lag applies to the schedule windows {list(SCHEDULE_WINDOWS)}, not {self.reduce!r}")

    @property
    def name(self) -> str:
        """The column's identifier in CSVs (`tidy_name` of its label)."""
        return tidy_name(self.label)

    def definition(self) -> str:
        """What the column holds per run, in words: its MLflow metric and reduction."""
        lag = ", each step's value read from the step before" if self.lag else ""
        return f"`{self.key}`: {REDUCTION_TEXT[self.reduce]}{lag}"


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

    def reduced(self, column: Column) -> float:
        """The column's metric over this run's steps, reduced (`reduce_values`, or a `SCHEDULE_WINDOWS` mean)."""
        if column.reduce not in SCHEDULE_WINDOWS:
            return reduce_values(self.series(column.key), column.reduce)
        windows = schedule_windows(self.params)
        if windows is None:
            return math.nan
        first, last = windows[column.reduce]
        values = [v for step, v in self.history.get(column.key, []) if first <= step + column.lag <= last]
        return reduce_values(values, "mean")


def schedule_windows(params: dict[str, str]) -> dict[str, tuple[float, float]] | None:
    """The logged steps (from 1, inclusive) of each `SCHEDULE_WINDOWS` window of a run, None without a schedule.

    The first calibration uses the shadow of the step with index f (from 0: ``clipping.first_step``, else
    ``clipping.interval`` = K), after that step's update, and is in force from the next step, so logged steps
    1..f + 1 run at the initial bounds (``mean_initial_bounds``) and f + 2 on at calibrated ones
    (``mean_calibrated_bounds``). ``mean_steps_2_to_k1`` / ``mean_steps_from_k2`` depend on K alone: the same
    steps for every schedule with that K (the default schedule's initial steps but the first, and the rest)."""
    if params.get("clipping.interval") is None:
        return None
    k = int(params["clipping.interval"])
    first = params.get("clipping.first_step", "None")
    f = k if first == "None" else int(first)
    return {
        "mean_initial_bounds": (1, f + 1),
        "mean_calibrated_bounds": (f + 2, math.inf),
        "mean_steps_2_to_k1": (2, k + 1),
        "mean_steps_from_k2": (k + 2, math.inf),
    }


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
    newest_only: bool = False,
) -> tuple[list[RunData], list[str], str]:
    """The training runs of `experiment` (oldest first) with the histories of `keys`: (runs, group_by, uri).
    ``newest_only``: a re-run replaces an older run of the same group and seed (`newest_per_seed`)."""
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
    return (newest_per_seed(out)[0] if newest_only else out), group_by, uri


def newest_per_seed(run_data: Sequence[RunData]) -> tuple[list[RunData], int]:
    """(the newest run of each (group, seed), how many older ones it replaced) from runs ordered oldest first:
    a re-run with changed code or config (another config hash, same arm and seed) supersedes the old run, which
    stays in MLflow."""
    newest: dict[tuple, RunData] = {}
    for run in run_data:
        newest.pop((run.group, run_seed(run)), None)  # re-inserted: the kept runs stay in age order
        newest[(run.group, run_seed(run))] = run
    return list(newest.values()), len(run_data) - len(newest)


def reduce_values(values: Sequence[float], reduce: str) -> float:
    """One run's steps -> one number (NaN for a metric the run never logged). ``last3``: the mean of the last
    3 values (e.g. the last 3 evaluations)."""
    if not values:
        return math.nan
    if reduce == "last3":
        return float(pd.Series(values[-3:], dtype=float).mean())
    if reduce in ("surge_ratio", "surged"):
        if len(values) < 4:
            return math.nan
        surge = detect_surge(values, SURGE_RULE)
        return surge.ratio if reduce == "surge_ratio" else float(surge.surged)
    series = pd.Series(values, dtype=float)
    if reduce in ("first", "last"):
        return float(series.iloc[0 if reduce == "first" else -1])
    return float(getattr(series, reduce)())


def run_seed(run: RunData) -> str:
    """The run's seed (its ``trainer.seed`` param, else a seed tag), "" when it has none."""
    for key in SEED_KEYS:
        value = run.params.get(key, run.tags.get(key))
        if value is not None:
            return str(value)
    return ""


def runs_frame(run_data: Sequence[RunData], columns: Sequence[Column], group_by: Sequence[str]) -> pd.DataFrame:
    """One row per run: run_id, run_name, git_sha, seed (unless a grouping key is the seed), the grouping keys,
    each column's reduced value."""
    seed = [] if "seed" in group_by else ["seed"]
    rows = []
    for run in run_data:
        row = {"run_id": run.run_id, "run_name": run.name, "git_sha": run.tags.get("git_sha", "")}
        row.update({"seed": run_seed(run)} if seed else {})
        row.update(dict(zip(group_by, run.group, strict=True)))
        row.update({c.label: run.reduced(c) for c in columns})
        rows.append(row)
    head = ["run_id", "run_name", "git_sha", *seed, *group_by]
    return pd.DataFrame(rows, columns=[*head, *(c.label for c in columns)])


def grouped(frame: pd.DataFrame, group_by: Sequence[str], columns: Sequence[Column]) -> pd.DataFrame:
    """Per group (in order of first appearance): ``runs`` and ``<label>:n`` / ``<label>:mean`` / ``<label>:std``
    (runs with a value, their mean and sample std, 0 for a single run; NaN values left out)."""
    labels = [c.label for c in columns]
    by = list(group_by) or [pd.Series("all", index=frame.index, name="group")]
    stats = frame.groupby(by, sort=False, dropna=False)[labels].agg(["count", "mean", "std"])
    stats.columns = [f"{label}:{'n' if stat == 'count' else stat}" for label, stat in stats.columns]
    for label in labels:
        stats[f"{label}:std"] = stats[f"{label}:std"].fillna(0.0).where(stats[f"{label}:mean"].notna())
    counts = frame.groupby(by, sort=False, dropna=False).size().rename("runs")
    return pd.concat([counts, stats], axis=1).reset_index()


def tidy_runs(per_run: pd.DataFrame, columns: Sequence[Column]) -> pd.DataFrame:
    """`runs_frame` with identifier column names (one row per run: a tidy CSV)."""
    return per_run.rename(columns={c.label: c.name for c in columns})


def tidy_stats(table: pd.DataFrame, group_by: Sequence[str], columns: Sequence[Column]) -> pd.DataFrame:
    """`grouped`'s table long: one row per group (in its order) and metric (in column order) with the grouping keys,
    ``metric`` (`Column.name`), ``n`` (the group's runs with a value), ``mean`` and ``std`` (empty below 2 runs): a
    tidy CSV."""
    rows = [
        {**{key: group[key] for key in group_by}, "metric": column.name}
        | {stat: group[f"{column.label}:{stat}"] for stat in ("n", "mean", "std")}
        for _, group in table.iterrows()
        for column in columns
    ]
    frame = pd.DataFrame(rows, columns=[*group_by, "metric", "n", "mean", "std"]).astype({"n": int})
    frame.loc[frame["n"] < 2, "std"] = math.nan  # no spread from one run (the Markdown shows its value alone)
    return frame


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


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(mean, low, high): the two-sided t-interval of the mean of `values` (NaN bounds below 2 values)."""
    series = pd.Series(values, dtype=float).dropna()
    n = len(series)
    if n == 0:
        return math.nan, math.nan, math.nan
    mean = float(series.mean())
    if n < 2:
        return mean, math.nan, math.nan
    half = float(stats.t.ppf((1 + confidence) / 2, n - 1) * series.std(ddof=1) / math.sqrt(n))
    return mean, mean - half, mean + half


def paired_differences(
    frame: pd.DataFrame, group: str, reference: str, labels: Sequence[str], seed: str = "seed"
) -> pd.DataFrame:
    """Per group other than `reference` and per column label: the differences group - reference over the seeds
    both have (pairs), their n, mean and 95% t-interval. Rows in order of first appearance."""
    ref = frame[frame[group] == reference].drop_duplicates(seed).set_index(seed)
    rows = []
    for name in dict.fromkeys(frame[group]):
        if name == reference:
            continue
        arm = frame[frame[group] == name].drop_duplicates(seed).set_index(seed)
        seeds = [s for s in arm.index if s in ref.index]
        for label in labels:
            diffs = [arm.at[s, label] - ref.at[s, label] for s in seeds]
            diffs = [d for d in diffs if not pd.isna(d)]
            mean, low, high = t_interval(diffs)
            p = float(stats.ttest_1samp(diffs, 0.0).pvalue) if len(diffs) >= 2 and not math.isnan(low) else math.nan
            rows.append(
                {group: name, "metric": label, "n": len(diffs), "mean": mean, "ci_low": low, "ci_high": high, "p": p}
            )
    return pd.DataFrame(rows, columns=[group, "metric", "n", "mean", "ci_low", "ci_high", "p"])


def holm(pvalues: pd.Series) -> pd.Series:
    """Holm's step-down adjustment of a family of p-values (NaN left out of the family and kept NaN): the k-th
    smallest of m times (m - k + 1), running maximum, capped at 1."""
    family = pvalues.dropna().sort_values()
    m = len(family)
    adjusted = (family * [m - k for k in range(m)]).cummax().clip(upper=1.0)
    return adjusted.reindex(pvalues.index)


def paired_cells(paired: pd.DataFrame, group: str, columns: Sequence[Column]) -> pd.DataFrame:
    """Display strings of `paired_differences`: one row per group, "mean [low, high]" per column label."""
    fmt = {c.label: c.fmt for c in columns}
    most = paired.groupby(group, sort=False)["n"].max()
    out: dict[str, dict[str, Any]] = {}
    for row in paired.itertuples(index=False):
        name, label = getattr(row, group), row.metric
        cell = "-" if pd.isna(row.mean) else _signed(fmt[label], row.mean)
        if not pd.isna(row.ci_low):
            cell += f" [{_signed(fmt[label], row.ci_low)}, {_signed(fmt[label], row.ci_high)}]"
        if getattr(row, "p_holm", math.nan) < 1 - CONFIDENCE:
            cell += " *"
        if row.n != most[name] and not pd.isna(row.mean):
            cell += f" (n={row.n})"
        out.setdefault(name, {group: name, "n": int(most[name])})[label] = cell
    return pd.DataFrame(list(out.values()))


def _signed(fmt: str, value: float) -> str:
    text = fmt.format(value)
    return text if text.startswith("-") else "+" + text
