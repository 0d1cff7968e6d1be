"""Paper tables from the finished runs of a sweep, and the mechanism study's tables, read from MLflow.

A table experiment's runs are grouped by the sweep's axes (seeds left out); each column reduces one
metric's per-step history of a run (last / mean of the last 3 evaluations / mean / sum / max, or the
entropy-surge detector), and a cell shows mean ± std over the group's runs. Where the sweep has a BF16 arm, a
second table gives each arm's per-seed paired differences against it with 95% t-intervals over the seeds; where
it has Calibrated Clipping arms and vanilla FP8 arms of the same precision, a third gives each CC arm's
differences against its vanilla counterpart and the share of vanilla's excess clipping over BF16 it removes.
Written per table: ``<name>.md`` (the key columns first, with the paper's numbers beside ours where the paper
reports the row, then every column), tidy CSVs with identifier column names (`Column.name`): ``<name>.csv`` (one
row per arm and metric: n, mean, std), ``<name>.paired.csv`` (the paired differences), ``<name>.runs.csv`` (one
row per run with its MLflow run id, git SHA and seed), and ``<name>.runs.json`` (each run's resolved config and
provenance tags). `rebuild_table` re-renders a table from its own ``.runs.csv`` and ``.runs.json``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from scipy import stats

from fp8rl.report.frames import (
    CONFIDENCE,
    SCHEDULE_WINDOWS,
    Column,
    RunData,
    cells,
    grouped,
    holm,
    load_runs,
    newest_per_seed,
    paired_cells,
    paired_differences,
    runs_frame,
    schedule_windows,
    tidy_runs,
    tidy_stats,
)
from fp8rl.report.paper import PAPER_METRIC, PAPER_SCORES
from fp8rl.report.surge import SurgeRule
from fp8rl.tracking import store as runs

log = logging.getLogger(__name__)

SURGE_RULE = SurgeRule()
TABLE_COLUMNS = (
    Column("acc (last 3 evals)", "eval/accuracy", "last3"),
    Column("acc, BF16 eval (last 3)", "eval/bf16/accuracy", "last3"),
    Column("peak entropy", "rollout/entropy", "max"),
    Column("surge ratio", "rollout/entropy", "surge_ratio", "{:.2f}"),
    Column("surged", "rollout/entropy", "surged", "{:.2f}"),
    Column("garbled (eval, last 3)", "eval/garbled_rate", "last3"),
    Column("garbled (rollout, mean)", "rollout/garbled_rate", "mean", "{:.4f}"),
    Column("response len (rollout)", "rollout/response_len", "mean", "{:.2f}"),
    Column("clip/low_neg (mean)", "clip/low_neg", "mean", "{:.4f}"),
    Column("clip/low_neg before 1st calibration", "clip/low_neg", "mean_initial_bounds", "{:.4f}"),
    Column("clip/low_neg after 1st calibration", "clip/low_neg", "mean_calibrated_bounds", "{:.4f}"),
    Column("overclip, CC out-of-sample", "clip/cc_oos_overclip_neg", "mean", "{:.4f}"),
    Column("overclip, standard bounds", "clip/shadow_overclip_neg", "mean", "{:.4f}"),
    Column("BF16 low_neg (shadow)", "clip/shadow_ref_low_neg", "mean", "{:.4f}"),
    Column("calib ok", "clip/calib_ok", "sum", "{:.1f}"),
    Column("calib alpha=0", "clip/calib_alpha_zero", "sum", "{:.1f}"),
    Column("calib p unreachable", "clip/calib_p_unreachable", "sum", "{:.1f}"),
    Column("step A<0 tokens", "clip/shadow_neg_tokens", "mean", "{:.0f}"),
    Column("calib pool A<0 tokens", "clip/calib_pool_neg", "last", "{:.0f}"),
    Column("reward (mean)", "rollout/reward", "mean"),
    Column("token_mult_prob_error", "rollout/token_mult_prob_error", "mean", "{:.4f}"),
)
# Columns whose per-seed differences against BF16 (same seed) the tables test with a t-interval.
PAIRED_LABELS = (
    "acc (last 3 evals)",
    "acc, BF16 eval (last 3)",
    "junk mass (probe, last 3)",
    "clip/low_neg (mean)",
    "clip/low_neg after 1st calibration",
    "clip/low_neg, steps K + 2 on",
    "garbled (rollout, mean)",
    "reward (mean)",
    "surge ratio",
)
REFERENCE_ARM = "bf16"
CALIBRATED = "calibrated"  # clipping.policy of a Calibrated Clipping arm
HOLM_NOTE = (
    f" `*`: the difference is still significant at {1 - CONFIDENCE:.0%} after Holm's correction over this section's "
    "arms, per metric (one-sample t-tests of the per-seed differences; `p` and `p_holm` in the `.paired.csv`)."
)
AGAINST_BF16 = (
    f"Per-seed paired differences against `{REFERENCE_ARM}` (same seed): mean [{CONFIDENCE:.0%} t-interval over the n "
    "seeds]; an interval that excludes 0 is a difference at that level, one that includes it is not." + HOLM_NOTE
)
AGAINST_VANILLA = (
    "Per-seed paired differences of each Calibrated Clipping arm against the vanilla FP8 arm with the same precision "
    f"settings (`against`, same seed; mean [{CONFIDENCE:.0%} t-interval])." + HOLM_NOTE
)
BOOTSTRAP_RESAMPLES = 9999
EXCESS_NOTE = (
    f" `excess removed`: the share of the vanilla arm's excess `clip/low_neg` over `{REFERENCE_ARM}`'s that Calibrated "
    "Clipping removes, 1 - (CC - BF16) / (vanilla - BF16), from the means over the seeds where all three arms have a "
    f"value on the same steps (`-` where vanilla does not exceed BF16), with a {CONFIDENCE:.0%} paired percentile "
    f"bootstrap interval over those seeds ({BOOTSTRAP_RESAMPLES} resamples; none below 3 seeds)."
)
# the columns whose excess over BF16 the comparison with vanilla FP8 reports as a share removed
EXCESS_LABELS = ("clip/low_neg (mean)", "clip/low_neg after 1st calibration")
WINDOW_NOTE = (
    "`before / after 1st calibration`: the mean over the steps that ran at the initial clip bounds under the run's "
    "calibration schedule and over the steps after them. The first calibration uses the shadow of the step with "
    "index f (from 0: `clipping.first_step`, else K = `clipping.interval`) and is in force from the next one, so "
    "logged steps 1 to f + 1 are before it; every run is split by its own schedule's fields (arms without Calibrated "
    "Clipping have them too), and a paired difference is left out (`-`) where the two runs' windows differ. "
    "`steps 2 to K + 1` / `steps K + 2 on` depend on K alone. A bound `in force` at a step is the one the step "
    "before logged."
)
# Columns a table adds to TABLE_COLUMNS: the collapse studies' junk rates (their task's own metric) and the junk
# organism's probe (results/studies/2026-12-06-junk-organism.md)
JUNK_RATES = (
    Column("junk tokens (rollout, mean)", "rollout/junk_token_rate", "mean", "{:.4f}"),
    Column("junk responses (rollout, mean)", "rollout/junk_response_rate", "mean", "{:.4f}"),
)
JUNK_PROBE = (
    Column("junk mass (probe, step 0)", "eval/junk_mass", "first", "{:.5f}"),
    Column("junk mass (probe, last 3)", "eval/junk_mass", "last3", "{:.5f}"),
    Column("probe entropy (last 3)", "eval/probe_entropy", "last3", "{:.4f}"),
    Column("A<0 gradients dropped (mean)", "clip/synthetic_overclip_neg", "mean", "{:.4f}"),
)
EXTRA_COLUMNS = {
    "collapse": JUNK_RATES,
    "junk_gate": (*JUNK_RATES, *JUNK_PROBE),
    "junk_dose": (*JUNK_RATES, *JUNK_PROBE),
    "junk_arms": (*JUNK_RATES, *JUNK_PROBE[:3]),
    "junk_fp8_pilot": (
        *JUNK_RATES,
        Column("FP8 over-clip of A<0 junk (mean)", "clip/overclip_neg_junk", "mean", "{:.4f}"),
        Column("FP8 under-clip of A<0 junk (mean)", "clip/underclip_neg_junk", "mean", "{:.4f}"),
        Column("FP8 over-clip of all A<0 (mean)", "clip/overclip_neg", "mean", "{:.4f}"),
        Column("FP8 under-clip of all A<0 (mean)", "clip/underclip_neg", "mean", "{:.4f}"),
        Column("junk share of A<0 tokens (mean)", "clip/neg_share_junk", "mean", "{:.4f}"),
    ),
    # the same steps for both schedules: 2 to K + 1 (at the standard bounds by default, calibrated with
    # first_step=0) and K + 2 on (calibrated in both)
    "ablation_first_calibration": tuple(
        column
        for window, steps in (("mean_steps_2_to_k1", "steps 2 to K + 1"), ("mean_steps_from_k2", "steps K + 2 on"))
        for column in (
            Column(f"clip/low_neg, {steps}", "clip/low_neg", window, "{:.4f}"),
            Column(f"lower bound in force, {steps}", "clip/bound_low", window, "{:.4f}", lag=1),
        )
    ),
}


def columns_of(experiment: str) -> tuple[Column, ...]:
    """The columns of a table experiment's table."""
    return (*TABLE_COLUMNS, *EXTRA_COLUMNS.get(experiment, ()))


def compare_name(key: str) -> str:
    """``"+experiment/arm"`` -> ``"arm"``, ``"sweep.trainer.seed"`` -> ``"seed"``."""
    return key.lstrip("+~").rsplit("/", 1)[-1].rsplit(".", 1)[-1]


def _paper_column(experiment: str, keys: list[tuple[str, ...]]) -> list[str]:
    scores = PAPER_SCORES.get(experiment, {})
    if experiment == "ablation_recal_interval":  # tiny K = 2/5/10 stands for the paper's 10/20/40
        ordered = list(scores.values())
        return [f"{ordered[i]:g}" if i < len(ordered) else "" for i in range(len(keys))]
    return [next((f"{scores[part]:g}" for part in key if part in scores), "") for key in keys]


KEY_LABELS = (  # the columns a table's Markdown shows first; the CSV and the full table below it hold them all
    "acc (last 3 evals)",
    "reward (mean)",
    "clip/low_neg (mean)",
    "clip/low_neg after 1st calibration",
    "surge ratio",
    "garbled (rollout, mean)",
)
EXTRA_KEY_LABELS = {  # a study's own key columns (from its `EXTRA_COLUMNS`), shown after `KEY_LABELS`
    "collapse": ("junk tokens (rollout, mean)",),
    "junk_gate": ("junk mass (probe, last 3)", "probe entropy (last 3)", "A<0 gradients dropped (mean)"),
    "junk_dose": ("junk mass (probe, last 3)", "probe entropy (last 3)", "A<0 gradients dropped (mean)"),
    "junk_arms": ("junk mass (probe, last 3)", "probe entropy (last 3)"),
    "junk_fp8_pilot": ("FP8 over-clip of A<0 junk (mean)", "FP8 over-clip of all A<0 (mean)"),
    "ablation_first_calibration": ("clip/low_neg, steps 2 to K + 1", "clip/low_neg, steps K + 2 on"),
}
CODEBOOK = "INDEX.md#columns"  # where `fp8rl.report index` defines every column (`columns_codebook`)


def key_labels(base: str, columns: Sequence[Column]) -> list[str]:
    """The labels of `columns` a table shows first: `KEY_LABELS`, then the experiment's `EXTRA_KEY_LABELS`."""
    wanted = (*KEY_LABELS, *EXTRA_KEY_LABELS.get(base, ()))
    present = {c.label for c in columns}
    return [label for label in wanted if label in present]


def columns_codebook(experiments: Sequence[str]) -> pd.DataFrame:
    """One row per column of the experiments' tables: its CSV name, its label in the Markdown, its definition."""
    seen: dict[str, Column] = {}
    for experiment in experiments:
        for column in columns_of(experiment):
            seen.setdefault(column.name, column)
    return pd.DataFrame(
        [(f"`{c.name}`", c.label, c.definition()) for c in seen.values()],
        columns=["metric (CSV)", "column (Markdown)", "per run: MLflow metric and reduction over its steps"],
    )


def provenance_header(experiment: str, source: TableRuns, rebuilt_from: str | None = None) -> str:
    """The table's first line: where its runs and values come from, their commits, machines and dates, the surge
    rule. A table built from MLflow says when; a re-rendered one does not (the same files give the same text)."""
    run_data = source.run_data
    shas = sorted(
        {r.tags.get("git_sha", "?")[:10] + ("-dirty" if r.tags.get("git_dirty") == "true" else "") for r in run_data}
    )
    hosts = sorted({r.tags.get("machine.hostname", "?") for r in run_data})
    dates = sorted(r.tags["date"][:10] for r in run_data if r.tags.get("date"))
    dated = f" ({dates[0]}{f' to {dates[-1]}' if dates[-1] != dates[0] else ''})" if dates else ""
    if rebuilt_from:
        source_text = f"(their per-run values as read from MLflow `{source.mlflow}`, kept in `{rebuilt_from}`)"
        made = "re-rendered from that file"
    else:
        source_text = f"from MLflow `{source.mlflow}`"
        made = f"generated {time.strftime('%Y-%m-%d %H:%M %Z')}"
    notes = ""
    if source.superseded:
        notes += (
            f" {source.superseded} older run(s) of the same arm and seed, superseded by a re-run, are left out (they "
            "stay in MLflow)."
        )
    if source.missing:
        notes += f" Columns added after the per-run file was written have no values here (`-`): {source.missing}."
    return (
        f"Table `{experiment}`: {len(run_data)} finished run(s) {source_text}; mean ± std over seeds. Runs at git "
        f"{', '.join(shas)} on {', '.join(hosts)}{dated}; {made} by `python -m fp8rl.report`. Surge detector: "
        f"fp8rl/report/surge.py (ratio >= {SURGE_RULE.ratio}, rise >= {SURGE_RULE.min_rise} nats); "
        f"`surged` = fraction of runs.{notes}"
    )


@dataclass
class TableRuns:
    """What a table is built from: the runs (tags and resolved configs), one row of reduced values per run
    (columns named by label), the grouping keys' names, the MLflow store they were read from, how many older runs
    re-runs superseded, and the table's columns that a per-run file written before them lacks."""

    run_data: list[RunData]
    per_run: pd.DataFrame
    names: list[str]
    mlflow: str
    superseded: int = 0
    missing: list[str] = field(default_factory=list)


def write_table(
    experiment: str,
    out_dir: Path,
    columns: Sequence[Column] = TABLE_COLUMNS,
    tracking_uri: str | None = None,
    name: str | None = None,
) -> list[Path]:
    """Build one table from the sweep `experiment` (MLflow experiment name) into `out_dir`."""
    every_run, group_by, uri = load_runs(
        experiment, [c.key for c in columns], tracking_uri=tracking_uri, newest_only=False
    )
    run_data, superseded = newest_per_seed(every_run)
    if not run_data:
        raise SystemExit(f"MLflow experiment {experiment!r} has no finished runs yet")
    names = [compare_name(g) for g in group_by]
    per_run = runs_frame(run_data, columns, group_by).rename(columns=dict(zip(group_by, names, strict=True)))
    source = TableRuns(run_data, per_run, names, runs.display_uri(uri), superseded)
    return _write(experiment, out_dir, columns, source, provenance_header(experiment, source), name)


def rebuild_table(
    experiment: str, out_dir: Path, columns: Sequence[Column] = TABLE_COLUMNS, name: str | None = None
) -> list[Path]:
    """Re-render a table in `out_dir` from its own ``<name>.runs.csv`` and ``<name>.runs.json`` (no MLflow store):
    the same numbers, in the current layout."""
    stem = name or experiment
    source = read_table_runs(out_dir, stem, columns)
    return _write(experiment, out_dir, columns, source, provenance_header(experiment, source, f"{stem}.runs.csv"), name)


HEAD_COLUMNS = ("run_id", "run_name", "git_sha", "seed")  # a per-run file's columns before the grouping keys


def read_table_runs(out_dir: Path, stem: str, columns: Sequence[Column]) -> TableRuns:
    """A written table's runs back from its ``.runs.csv`` (metric columns by CSV name or, in files written before
    the names, by label; floats as written, so exact) and ``.runs.json`` (configs, tags, the grouping keys).

    A column of the table that the file lacks (added to the table later) is NaN and named in `TableRuns.missing`;
    a file column that is no longer the table's is left out. Files written before ``.runs.json`` named the grouping
    keys hold no other columns than head, keys and the table's: the keys are the rest."""
    runs_csv, runs_json = out_dir / f"{stem}.runs.csv", out_dir / f"{stem}.runs.json"
    for path in (runs_csv, runs_json):
        if not path.exists():
            raise SystemExit(
                f"{path} is missing: a table's per-run files are written by `python -m fp8rl.report table ...` "
                "from MLflow after its sweep"
            )
    raw = pd.read_csv(runs_csv, dtype=str, keep_default_na=False)
    payload = json.loads(runs_json.read_text())
    by_column = {c.label: c for c in columns} | {c.name: c for c in columns}
    head = [h for h in HEAD_COLUMNS if h in raw.columns]
    names = payload.get("group_by") or [c for c in raw.columns if c not in head and c not in by_column]
    absent = [k for k in ("run_id", *names) if k not in raw.columns]
    if absent:
        raise SystemExit(f"{runs_csv} lacks the columns {absent} that {runs_json.name} names")
    per_run = raw[[*head, *names]].copy()
    missing = []
    for column in columns:
        found = next((c for c in (column.label, column.name) if c in raw.columns), None)
        if found is None:
            missing.append(column.name)
        per_run[column.label] = [float(v) if v else math.nan for v in raw[found]] if found else math.nan  # exact
    records = {r["run_id"]: r for r in payload["runs"]}
    run_data = [
        RunData(rid, records[rid]["run_name"], tuple(row), records[rid]["tags"], records[rid]["config"])
        for rid, row in zip(per_run["run_id"], per_run[names].itertuples(index=False, name=None), strict=True)
    ]
    return TableRuns(run_data, per_run, names, payload["mlflow"], int(payload.get("superseded", 0)), missing)


def _write(
    experiment: str, out_dir: Path, columns: Sequence[Column], source: TableRuns, header: str, name: str | None
) -> list[Path]:
    """The table's files: Markdown (`_markdown`), tidy CSVs (per group and metric, per run, paired) and the runs'
    configs and tags with the grouping keys."""
    per_run, names, run_data = source.per_run, source.names, source.run_data
    table = grouped(per_run, names, columns)
    stem = name or experiment
    out_dir.mkdir(parents=True, exist_ok=True)
    paired = _paired_section(per_run, names, columns, run_data)
    lines = _markdown(header, stem, table, names, columns, paired[0] if paired is not None else [])
    if paired is not None:
        paired_frame = paired[1].assign(metric=paired[1]["metric"].map({c.label: c.name for c in columns}))
        paired_frame.to_csv(out_dir / f"{stem}.paired.csv", index=False)
    md, csv_grouped, csv_runs = out_dir / f"{stem}.md", out_dir / f"{stem}.csv", out_dir / f"{stem}.runs.csv"
    md.write_text("\n".join(lines) + "\n")
    tidy_stats(table, names, columns).to_csv(csv_grouped, index=False)
    tidy_runs(per_run, columns).to_csv(csv_runs, index=False)
    configs = out_dir / f"{stem}.runs.json"
    records = [{"run_id": r.run_id, "run_name": r.name, "tags": r.tags, "config": r.params} for r in run_data]
    payload = {"mlflow": source.mlflow, "experiment": experiment, "group_by": names, "runs": records}
    payload |= {"superseded": source.superseded} if source.superseded else {}
    configs.write_text(json.dumps(_without_local_paths(payload), indent=1, sort_keys=True))
    return [md, csv_grouped, csv_runs, configs, *([out_dir / f"{stem}.paired.csv"] if paired is not None else [])]


def _markdown(
    header: str, stem: str, table: pd.DataFrame, names: list[str], columns: Sequence[Column], paired: list[str]
) -> list[str]:
    """The table's Markdown lines: the key columns (with the paper's score), every column folded, notes, and the
    paired sections."""
    display = cells(table, names, columns)
    base = stem.rsplit("-", 1)[0]
    key = display[[*names, "runs", *key_labels(base, columns)]].copy()
    if base in PAPER_SCORES:
        key.insert(len(names) + 1, "paper", _paper_column(base, [tuple(r) for r in table[names].astype(str).values]))
    groups = " and ".join(names) or "group"
    lines = [header, "", key.to_markdown(index=False), ""]
    lines += [
        f"All {len(columns)} columns: below, and in [{stem}.csv]({stem}.csv) (one row per {groups} and metric, with n, "
        f"mean and std; one row per run in [{stem}.runs.csv]({stem}.runs.csv)); each column's definition: "
        f"[{CODEBOOK}]({CODEBOOK}).",
        "",
        f"<details><summary>all {len(columns)} columns</summary>",
        "",
        display.to_markdown(index=False),
        "",
        "</details>",
    ]
    if any(c.reduce in SCHEDULE_WINDOWS for c in columns):
        lines += ["", WINDOW_NOTE]
    if base in PAPER_SCORES:
        lines += [
            "",
            f"paper: {PAPER_METRIC[base]} (approximate, from the paper's summary; not comparable in absolute "
            "value to our task accuracy: compare orderings and gaps to BF16).",
        ]
    return lines + (["", *paired] if paired else [])


def _paired_section(per_run: pd.DataFrame, names: list[str], columns: Sequence[Column], run_data: list[RunData]):
    """(markdown lines, frame) of the per-seed differences of each arm against BF16 and of each Calibrated
    Clipping arm against its vanilla FP8 counterpart (`vanilla_counterparts`), or None without either."""
    if len(names) != 1:
        return None
    arm, labels = names[0], [c.label for c in columns if c.label in PAIRED_LABELS]
    shown = [c for c in columns if c.label in labels]
    arms = list(dict.fromkeys(per_run[arm]))
    has_reference = REFERENCE_ARM in arms
    against_bf16 = {a: REFERENCE_ARM for a in arms if a != REFERENCE_ARM} if has_reference else {}
    against_vanilla = vanilla_counterparts(run_data)
    if not labels or not (against_bf16 or against_vanilla):
        return None
    text, frames = [], []
    sections = ((against_bf16, AGAINST_BF16, False), (against_vanilla, AGAINST_VANILLA, has_reference))
    for pairs, title, with_excess in (section for section in sections if section[0]):
        paired = _paired_against(per_run, arm, pairs, labels, columns, run_data)
        display = paired_cells(paired, arm, shown)
        display.insert(1, "against", [pairs[a] for a in display[arm]])
        if with_excess:  # the share of vanilla's excess over BF16 removed
            title += EXCESS_NOTE
            display = display.merge(_excess_removed(per_run, arm, pairs, columns, run_data), on=arm, how="left")
        text += ["", title, "", display.to_markdown(index=False)]
        frames.append(paired)
    return text[1:], pd.concat(frames, ignore_index=True)


def vanilla_counterparts(run_data: Sequence[RunData]) -> dict[str, str]:
    """Each Calibrated Clipping arm (``clipping.policy=calibrated``) -> the one arm of the table without it whose
    runs have the same ``precision.*`` settings (vanilla FP8 of the same recipe): every setting the two arms'
    runs share has one value across all of them. A Calibrated Clipping arm with no such arm (an ablation's) is left
    out, one with several too, with a warning."""
    policies: dict[str, set[str | None]] = {}
    precision: dict[str, dict[str, set[str]]] = {}
    for run in (r for r in run_data if len(r.group) == 1):
        policies.setdefault(run.group[0], set()).add(run.params.get("clipping.policy"))
        settings = precision.setdefault(run.group[0], {})
        for key, value in run.params.items():
            if key.startswith("precision."):
                settings.setdefault(key, set()).add(value)
    calibrated = [a for a, p in policies.items() if p == {CALIBRATED}]
    vanilla = [a for a, p in policies.items() if CALIBRATED not in p]
    pairs = {}
    for name in calibrated:
        matches = [a for a in vanilla if _same_settings(precision[name], precision[a])]
        if len(matches) == 1:
            pairs[name] = matches[0]
        elif matches:
            log.warning("%s: several vanilla arms with its precision settings (%s); not paired", name, matches)
    return pairs


def _same_settings(a: dict[str, set[str]], b: dict[str, set[str]]) -> bool:
    """Every key both have holds one and the same value in both (and they share at least one key)."""
    shared = a.keys() & b.keys()
    return bool(shared) and all(len(a[k]) == 1 and a[k] == b[k] for k in shared)


def _paired_against(
    per_run: pd.DataFrame,
    arm: str,
    pairs: dict[str, str],
    labels: Sequence[str],
    columns: Sequence[Column],
    run_data: list[RunData],
) -> pd.DataFrame:
    """`paired_differences` of each arm against its own reference arm (`pairs`), with a ``against`` column."""
    frames = []
    for name, reference in pairs.items():
        both = per_run[per_run[arm].isin([name, reference])]
        comparable = _unpaired_windows_left_out(both, arm, columns, run_data, reference)
        frames.append(paired_differences(comparable, arm, reference, labels).assign(against=reference))
    paired = pd.concat(frames, ignore_index=True)
    paired["p_holm"] = paired.groupby("metric")["p"].transform(holm)  # the section's arms are one family per metric
    return paired[[arm, "against", *(c for c in paired.columns if c not in (arm, "against"))]]


def _excess_removed(
    per_run: pd.DataFrame, arm: str, pairs: dict[str, str], columns: Sequence[Column], run_data: list[RunData]
) -> pd.DataFrame:
    """Per Calibrated Clipping arm: 1 - (CC - BF16) / (vanilla - BF16) of each `EXCESS_LABELS` column, from the
    means over the seeds where the three arms all have a value on the same steps; "-" where vanilla's mean does
    not exceed BF16's (no excess to remove)."""
    labels = [label for label in EXCESS_LABELS if label in per_run.columns]
    rows = []
    for name, vanilla in pairs.items():
        trio = per_run[per_run[arm].isin([name, vanilla, REFERENCE_ARM])]
        for reference in (vanilla, REFERENCE_ARM):  # a window on other steps than either reference's: left out
            trio = _unpaired_windows_left_out(trio, arm, columns, run_data, reference)
        row = {arm: name}
        for label in labels:
            values = trio.drop_duplicates([arm, "seed"]).pivot(index="seed", columns=arm, values=label).dropna()
            row[f"excess removed, {label}"] = _share_removed_cell(values, name, vanilla)
        rows.append(row)
    return pd.DataFrame(rows, columns=[arm, *(f"excess removed, {label}" for label in labels)])


def excess_removed(cc: Any, vanilla: Any, reference: Any, axis: int = -1) -> Any:
    """1 - (CC - BF16) / (vanilla - BF16) of the means over the last axis (the seeds): the share of vanilla's excess
    over BF16 that Calibrated Clipping removes."""
    mean_ref = reference.mean(axis=axis)
    return 1 - (cc.mean(axis=axis) - mean_ref) / (vanilla.mean(axis=axis) - mean_ref)


def _share_removed_cell(values: pd.DataFrame, name: str, vanilla: str) -> str:
    """ "80% [66%, 94%]": `excess_removed` over the seeds (rows of `values`) with a paired percentile bootstrap
    interval (scipy.stats.bootstrap, resampling seeds, fixed seed); "-" where vanilla's mean does not exceed BF16's."""
    if not all(a in values for a in (name, vanilla, REFERENCE_ARM)) or len(values) == 0:
        return "-"
    cc, van, ref = (values[a].to_numpy(dtype=float) for a in (name, vanilla, REFERENCE_ARM))
    if not van.mean() > ref.mean():
        return "-"
    share = float(excess_removed(cc, van, ref))
    if len(values) < 3:
        return f"{share:.0%}"
    interval = stats.bootstrap(
        (cc, van, ref),
        excess_removed,
        paired=True,
        vectorized=True,
        n_resamples=BOOTSTRAP_RESAMPLES,
        confidence_level=CONFIDENCE,
        method="percentile",
        random_state=0,
    ).confidence_interval
    return f"{share:.0%} [{interval.low:.0%}, {interval.high:.0%}]"


def _unpaired_windows_left_out(
    per_run: pd.DataFrame, arm: str, columns: Sequence[Column], run_data: list[RunData], reference: str = REFERENCE_ARM
) -> pd.DataFrame:
    """`per_run` with a window column set to NaN in each run whose window of steps differs from the same-seed
    `reference` run's (two schedules: not a paired comparison)."""
    windows = {run.run_id: schedule_windows(run.params) or {} for run in run_data}
    frame = per_run.copy()
    ref_runs = frame[frame[arm] == reference].drop_duplicates("seed").set_index("seed")["run_id"]
    for column in (c for c in columns if c.reduce in SCHEDULE_WINDOWS):
        own = [windows[run_id].get(column.reduce) for run_id in frame["run_id"]]
        ref = [windows.get(ref_runs.get(seed), {}).get(column.reduce) for seed in frame["seed"]]
        frame.loc[[a != b for a, b in zip(own, ref, strict=True)], column.label] = math.nan
    return frame


def _without_local_paths(value: Any) -> Any:
    """Strings that are absolute paths of this machine (or URIs holding one) made relative to the working
    directory, or reduced to their last part: results carry no machine's paths."""
    if isinstance(value, dict):
        return {k: _without_local_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_local_paths(v) for v in value]
    if isinstance(value, str) and ("/" in value) and (value.startswith("/") or "://" in value):
        if value.startswith("sqlite:///"):
            return runs.display_uri(value)
        if value.startswith("/"):
            path = Path(value)
            try:
                return str(path.relative_to(Path.cwd()))
            except ValueError:
                return f"<local>/{path.name}"
        return runs.display_uri(value)
    if isinstance(value, str):  # a path inside a text (a run's description): relative to the working directory
        return value.replace(f"{Path.cwd()}/", "")
    return value


def summarize_runs(
    run_ids: dict[str, str | None], columns: Sequence[Column], tracking_uri: str | None = None
) -> pd.DataFrame:
    """One row per named run (e.g. the demo's arms), each column reduced over the run's steps."""
    client = runs.client(runs.absolute_tracking_uri(tracking_uri))
    rows = []
    for name, run_id in run_ids.items():
        run = client.get_run(run_id) if run_id else None
        histories = runs.metric_histories(client, run, [c.key for c in columns]) if run else {}
        data = RunData(run_id or "", name, (name,), {}, {}, histories)
        rows.append({"run": name, **{c.label: data.reduced(c) for c in columns}})
    return pd.DataFrame(rows)


def write_frame(frame: pd.DataFrame, out_dir: Path, stem: str, title: str) -> list[Path]:
    """``<stem>.md`` (a title line and the table) and ``<stem>.csv``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md, csv_path = out_dir / f"{stem}.md", out_dir / f"{stem}.csv"
    md.write_text(f"{title}\n\n{frame.to_markdown(index=False, floatfmt='.4f')}\n")
    frame.to_csv(csv_path, index=False)
    return [md, csv_path]
