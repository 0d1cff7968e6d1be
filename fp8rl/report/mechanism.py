"""The mechanism study's tables (`make mechanism`): one PPO update per cell, FP8 against its BF16 shadow on the
same tokens; fractions with Wilson 95% intervals and the paired tokens with an exact McNemar test."""

from __future__ import annotations

import csv
import math
import statistics
import time
from pathlib import Path
from typing import Any

from scipy import stats

from fp8rl.tracking import store as runs

# (label, metric, format, the metric holding the count a fraction is over: a Wilson 95% interval, or None)
MECH_FULL_COLUMNS: tuple[tuple[str, str, str, str | None], ...] = (
    ("log-ratio std BF16", "mech/ref_log_ratio_std", "{:.4f}", None),
    ("log-ratio std FP8", "mech/log_ratio_std", "{:.4f}", None),
    ("logp noise", "mech/logp_abs_noise", "{:.4f}", None),
    ("low_neg FP8", "clip/low_neg", "{:.4f}", "mech/neg_tokens"),
    ("low_neg BF16", "clip/ref_low_neg", "{:.4f}", "mech/neg_tokens"),
    ("overclip_neg", "clip/overclip_neg", "{:.4f}", "mech/neg_tokens"),
    ("underclip_neg", "clip/underclip_neg", "{:.4f}", "mech/neg_tokens"),
    ("McNemar p", "mech/mcnemar_p", "{:.2g}", None),
    ("p FP8", "clip/p", "{:.3f}", None),
    ("p BF16", "clip/ref_p", "{:.3f}", None),
    ("clip precision", "clip/overlap_precision", "{:.2f}", None),
    ("clip recall", "clip/overlap_recall", "{:.2f}", None),
    ("CC low", "cc/low", "{:.3f}", None),
    ("CC high", "cc/high", "{:.3f}", None),
    ("CC low_neg (oos)", "cc/low_neg", "{:.4f}", "cc/neg_tokens"),
    ("CC overclip_neg (oos)", "cc/overclip_neg", "{:.4f}", "cc/neg_tokens"),
    ("CC p (oos)", "cc/p", "{:.3f}", None),
    ("CC precision (oos)", "cc/overlap_precision", "{:.2f}", None),
    ("CC recall (oos)", "cc/overlap_recall", "{:.2f}", None),
    ("neg tokens", "mech/neg_tokens", "{:.0f}", None),
)
MECH_ORDER = ("fp32", "bf16", "tensorwise", "rowwise", "blockwise", "mxfp8")


def wilson_interval(fraction: float, n: float, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score 95% interval of a binomial share `fraction` of `n` trials.

    Written out rather than taken from scipy: `stats.binomtest(k, n).proportion_ci(method="wilson")` takes
    integer counts, and the shares here (``clip/*`` means over micro-batches) are not integer counts of their
    ``n``; rounding them first moves the interval of 349 of the mechanism table's 1200 cells."""
    if n <= 0 or math.isnan(fraction):
        return math.nan, math.nan
    centre = (fraction + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(fraction * (1 - fraction) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_p(metrics: dict[str, float]) -> float:
    """Exact McNemar test of FP8 and BF16 clipping the same negative tokens: the tokens only FP8 clips
    (``clip/overclip_neg``) against those only BF16 clips (``clip/underclip_neg``), each a share of
    ``mech/neg_tokens``; two-sided binomial p of the first count among both at 1/2. NaN without the counts; 1.0
    where neither clips a token the other does not."""
    if not {"clip/overclip_neg", "clip/underclip_neg", "mech/neg_tokens"} <= metrics.keys():
        return math.nan
    n = metrics["mech/neg_tokens"]
    only_fp8, only_bf16 = round(metrics["clip/overclip_neg"] * n), round(metrics["clip/underclip_neg"] * n)
    if only_fp8 + only_bf16 == 0:
        return 1.0
    return float(stats.binomtest(only_fp8, only_fp8 + only_bf16, 0.5).pvalue)


def _mech_cell(metrics: dict[str, float], key: str, fmt: str, n_key: str | None) -> str:
    if key not in metrics:
        return "-"
    text = fmt.format(metrics[key])
    if n_key is not None and n_key in metrics:
        low, high = wilson_interval(metrics[key], metrics[n_key])
        text += f" [{fmt.format(low)}, {fmt.format(high)}]"
    return text


def load_mechanism(experiment: str, tracking_uri: str | None = None) -> tuple[list[Any], str]:
    uri = runs.absolute_tracking_uri(tracking_uri)
    client = runs.client(uri)
    exp_id = runs.experiment_id(client, experiment, create=False)
    if exp_id is None:
        raise SystemExit(f"no MLflow experiment {experiment!r} in {runs.display_uri(uri)}: run `make mechanism` first")
    found = runs.search(client, exp_id, "tags.`fp8rl.mechanism` = 'cell' and attributes.status = 'FINISHED'")
    newest: dict[str, Any] = {}
    for run in sorted(found, key=lambda r: r.info.start_time):
        newest[run.data.tags["fp8rl.mechanism_cell"]] = run  # a re-run cell replaces the old one
    return list(newest.values()), uri


def _cell_sort_key(run: Any) -> tuple:
    """Variant, checkpoint, mode, recipe, then the measured BF16 log-ratio spread (the update's real size)."""
    p = run.data.params
    return (
        p["variant"] != "none",
        p["variant"],
        p["checkpoint"] != "early",
        p["mode"],
        MECH_ORDER.index(p["recipe"]) if p["recipe"] in MECH_ORDER else 99,
        run.data.metrics.get("mech/ref_log_ratio_std", float(p["lr"])),
    )


def mechanism_markdown(cells: list[Any], mode: str, header: str) -> str:
    keys = ("variant", "checkpoint", "recipe", "lr")
    head = [*keys, *(c[0] for c in MECH_FULL_COLUMNS)]
    lines = [header, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in sorted((r for r in cells if r.data.params["mode"] == mode), key=_cell_sort_key):
        p, m = run.data.params, {**run.data.metrics, "mech/mcnemar_p": mcnemar_p(run.data.metrics)}
        values = [_mech_cell(m, key, fmt, n_key) for _, key, fmt, n_key in MECH_FULL_COLUMNS]
        lines.append("| " + " | ".join([p["variant"], p["checkpoint"], p["recipe"], p["lr"], *values]) + " |")
    return "\n".join(lines) + "\n"


def noise_markdown(cells: list[Any], header: str) -> str:
    """The granularity ordering: raw log-prob noise and the over-clip rate per recipe, with/without outliers."""
    table: dict[tuple[str, str], dict[str, tuple[float, list[float]]]] = {}
    for run in cells:
        p, m = run.data.params, run.data.metrics
        if p["mode"] != "full" or p["recipe"] in ("bf16", "fp32"):
            continue
        row = table.setdefault((p["variant"], p["checkpoint"]), {})
        noise, overclips = row.get(p["recipe"], (m.get("mech/logp_abs_noise", math.nan), []))
        overclips.append(m.get("clip/overclip_neg", math.nan))
        row[p["recipe"]] = (noise, overclips)
    recipes = [r for r in MECH_ORDER if r not in ("bf16", "fp32") and any(r in row for row in table.values())]
    head = ["variant", "checkpoint", *(f"{r}: noise / overclip_neg" for r in recipes)]
    lines = [header, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (variant, checkpoint), row in sorted(table.items(), key=lambda kv: (kv[0][0] != "none", kv[0])):
        cells_ = [f"{row[r][0]:.4f} / {statistics.fmean(row[r][1]):.4f}" if r in row else "-" for r in recipes]
        lines.append("| " + " | ".join([variant, checkpoint, *cells_]) + " |")
    return "\n".join(lines) + "\n"


def noise_scan_markdown(cells: list[Any], header: str) -> str:
    """Raw log-prob noise per recipe against the injected outlier scale (mode ``noise_scan``)."""
    scan = [r for r in cells if r.data.params["mode"] == "noise_scan"]
    recipes = [r for r in MECH_ORDER if any(f"noise/{r}" in c.data.metrics for c in scan)]
    head = ["checkpoint", "outlier scale", *recipes]
    lines = [header, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in sorted(
        scan, key=lambda r: (r.data.params["checkpoint"] != "early", r.data.metrics.get("mech/outlier_scale", 0))
    ):
        m = run.data.metrics
        values = [f"{m[f'noise/{r}']:.4f}" if f"noise/{r}" in m else "-" for r in recipes]
        lines.append(
            "| " + " | ".join([run.data.params["checkpoint"], f"{m.get('mech/outlier_scale', 0):g}", *values]) + " |"
        )
    return "\n".join(lines) + "\n"


def write_mechanism(experiment: str, out_dir: Path, tracking_uri: str | None = None) -> list[Path]:
    cells, uri = load_mechanism(experiment, tracking_uri)
    if not cells:
        raise SystemExit(f"MLflow experiment {experiment!r} has no finished mechanism cells: run `make mechanism`")
    out_dir.mkdir(parents=True, exist_ok=True)
    shas = sorted({r.data.tags.get("git_sha", "?")[:10] for r in cells})
    base = (
        f"Mechanism study ({len(cells)} cells, MLflow `{runs.display_uri(uri)}`, experiment `{experiment}`, "
        f"git {', '.join(shas)}; "
        f"generated {time.strftime('%Y-%m-%d %H:%M %Z')}). One PPO mini-batch update (AdamW, lr as listed) "
        "from the checkpoint, ratios measured on the batch's other mini-batch; tokens of the study's GRPO "
        "batches pooled. Rows are ordered by the measured BF16 log-ratio spread (the update's real size; a "
        "fresh AdamW's first step is sign descent, so lr does not map onto an RL run's); the `fp32` row is the "
        "same without BF16 autocast (BF16's own noise floor shows against it). `overclip_neg`: "
        "negative-advantage tokens FP8 clips at 0.8 and BF16 does not, / all negative tokens; "
        "`precision`/`recall`: overlap of the tokens FP8 clips with those BF16 clips; `CC ... (oos)`: after "
        "Calibrated Clipping calibrated on one batch and measured on another (out of sample). Fractions carry "
        "Wilson 95% intervals over the negative tokens they count. `McNemar p`: exact McNemar test, paired over "
        "the same tokens, of the tokens only FP8 clips (`overclip_neg`) against those only BF16 clips "
        "(`underclip_neg`)."
    )
    written = []
    for mode, what in (
        ("full", "full pipeline FP8 (old and new log-probs in the recipe) vs the BF16 shadow"),
        ("mismatch", "mismatched: old log-probs from an FP8 rollout engine, new ones from a BF16 trainer"),
    ):
        path = out_dir / f"mechanism_{mode}.md"
        path.write_text(mechanism_markdown(cells, mode, f"{base}\n\nMode: {what}."))
        written.append(path)
    noise = out_dir / "mechanism_granularity.md"
    noise.write_text(
        noise_markdown(
            cells,
            f"{base}\n\nGranularity ordering: mean |logp_FP8 - logp_BF16| "
            "per token at the checkpoint / over-clip rate averaged over the learning rates.",
        )
    )
    written.append(noise)
    if any(r.data.params["mode"] == "noise_scan" for r in cells):
        scan = out_dir / "mechanism_outlier_scan.md"
        scan.write_text(
            noise_scan_markdown(
                cells,
                f"{base}\n\nOutlier scan: mean |logp_FP8 - logp_BF16| over the "
                "sampled response tokens with 4 injected outlier channels of the given scale "
                "(1 = none), forwards only.",
            )
        )
        written.append(scan)
    rows = out_dir / "mechanism.runs.csv"
    metric_keys = sorted({k for r in cells for k in r.data.metrics})
    with open(rows, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["run_id", "cell", "git_sha", "variant", "checkpoint", "mode", "recipe", "lr", *metric_keys])
        for r in sorted(cells, key=_cell_sort_key):
            p = r.data.params
            writer.writerow(
                [
                    r.info.run_id,
                    r.data.tags["fp8rl.mechanism_cell"],
                    r.data.tags.get("git_sha", ""),
                    p["variant"],
                    p["checkpoint"],
                    p["mode"],
                    p["recipe"],
                    p["lr"],
                    *(r.data.metrics.get(k, "") for k in metric_keys),
                ]
            )
    written.append(rows)
    return written
