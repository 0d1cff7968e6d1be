"""Figures from MLflow: training curves per table (one figure each) and the mechanism study's plots.

Every figure is written as PNG and PDF. Curves are the mean over a group's seeds at each step.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any

from fp8rl.report.tables import MECH_ORDER, compare_name, load_mechanism, load_runs
from fp8rl.tracking import store as runs

CURVE_PANELS = (  # (title, [(metric key, line style)])
    ("actor entropy (rollout)", [("rollout/entropy", "-")]),
    ("reward", [("rollout/reward", "-")]),
    ("response length", [("rollout/response_len", "-")]),
    ("clip fraction: low_neg (solid), high_pos (dashed)", [("clip/low_neg", "-"), ("clip/high_pos", "--")]),
    ("contribution: positive (solid), negative (dashed)", [("clip/contrib_pos", "-"), ("clip/contrib_neg", "--")]),
    ("eval accuracy", [("eval/accuracy", "-")]),
)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, out_dir: Path, stem: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.png", out_dir / f"{stem}.pdf"]
    for path in paths:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    _plt().close(fig)
    return paths


def mean_curve(histories: list[list[tuple[int, float]]]) -> tuple[list[int], list[float]]:
    by_step: dict[int, list[float]] = {}
    for history in histories:
        for step, value in history:
            if math.isfinite(value):
                by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    return steps, [statistics.fmean(by_step[s]) for s in steps]


def training_curves(experiment: str, out_dir: Path, tracking_uri: str | None = None) -> list[Path]:
    keys = [k for _, lines in CURVE_PANELS for k, _ in lines]
    run_data, group_by, uri = load_runs(experiment, keys, tracking_uri=tracking_uri)
    if not run_data:
        return []
    groups: dict[tuple[str, ...], list] = {}
    for r in run_data:
        groups.setdefault(r.group, []).append(r)
    plt = _plt()
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, lines) in zip(axes.flat, CURVE_PANELS, strict=True):
        for i, (group, members) in enumerate(groups.items()):
            label = " ".join(group) if group else "all"
            for key, style in lines:
                steps, values = mean_curve([m.history.get(key, []) for m in members])
                if steps:
                    ax.plot(steps, values, style, color=colors[i % len(colors)], label=label if style == "-" else None)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
    axes.flat[0].legend(fontsize=7, title=", ".join(map(compare_name, group_by)), title_fontsize=7)
    fig.suptitle(f"{experiment}: mean over seeds ({len(run_data)} runs, MLflow {uri})", fontsize=10)
    fig.tight_layout()
    return _save(fig, out_dir, f"{experiment}_curves")


def _histogram(client: Any, run_id: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = client.download_artifacts(run_id, "ratio_histograms.json", tmp)
        return json.loads(Path(path).read_text())


def mechanism_figures(
    experiment: str, out_dir: Path, tracking_uri: str | None = None, hist_lr: str = "1e-05"
) -> list[Path]:
    cells, uri = load_mechanism(experiment, tracking_uri)
    if not cells:
        return []
    client = runs.client(uri)
    plt = _plt()
    written: list[Path] = []
    cells = [c for c in cells if c.data.params["mode"] in ("full", "mismatch")]  # not the forward-only noise scan
    if not cells:
        return []
    variants = sorted({c.data.params["variant"] for c in cells}, key=lambda v: (v != "none", v))
    checkpoints = sorted({c.data.params["checkpoint"] for c in cells}, key=lambda c: c != "early")
    recipes = [r for r in MECH_ORDER if r != "bf16" and any(c.data.params["recipe"] == r for c in cells)]
    # (1) over-clip rate vs learning rate, per variant x checkpoint; full pipeline solid, after CC dashed
    fig, axes = plt.subplots(
        len(variants), len(checkpoints), figsize=(6 * len(checkpoints), 4 * len(variants)), squeeze=False
    )
    for ax, (variant, checkpoint) in zip(axes.flat, [(v, c) for v in variants for c in checkpoints], strict=True):
        for recipe in recipes:
            sel = sorted(
                (
                    c
                    for c in cells
                    if c.data.params["variant"] == variant
                    and c.data.params["checkpoint"] == checkpoint
                    and c.data.params["mode"] == "full"
                    and c.data.params["recipe"] == recipe
                ),
                key=lambda c: float(c.data.params["lr"]),
            )
            lrs = [float(c.data.params["lr"]) for c in sel]
            line = ax.plot(lrs, [c.data.metrics.get("clip/overclip_neg", math.nan) for c in sel], "-o", label=recipe)
            ax.plot(
                lrs, [c.data.metrics.get("cc/overclip_neg", math.nan) for c in sel], "--", color=line[0].get_color()
            )
        ax.set_xscale("log")
        ax.set_xlabel("learning rate of the one update")
        ax.set_ylabel("over-clipped negative tokens (share)")
        ax.set_title(f"{variant}, {checkpoint} checkpoint (solid: standard bounds, dashed: Calibrated)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    written += _save(fig, out_dir, "mechanism_overclip_vs_lr")
    # (2) log-ratio histograms, BF16 shadow vs FP8, split by advantage sign, at `hist_lr`, late checkpoint
    for variant in variants:
        sel = {
            c.data.params["recipe"]: c
            for c in cells
            if c.data.params["variant"] == variant
            and c.data.params["checkpoint"] == checkpoints[-1]
            and c.data.params["mode"] == "full"
            and c.data.params["lr"] in (hist_lr, str(float(hist_lr)))
        }
        present = [r for r in recipes if r in sel]
        if not present:
            continue
        fig, axes = plt.subplots(1, len(present), figsize=(4.5 * len(present), 3.6), squeeze=False)
        for ax, recipe in zip(axes.flat, present, strict=True):
            hist = _histogram(client, sel[recipe].info.run_id)
            edges = hist["edges"]
            centers = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:], strict=True)]
            for sign, color in (("neg", "tab:red"), ("pos", "tab:blue")):
                ax.step(
                    centers,
                    hist[f"fp8_{sign}"],
                    where="mid",
                    color=color,
                    label=f"FP8, A {'<' if sign == 'neg' else '>'} 0",
                )
                ax.step(
                    centers,
                    hist[f"bf16_{sign}"],
                    where="mid",
                    color=color,
                    linestyle="--",
                    alpha=0.7,
                    label=f"BF16 shadow, A {'<' if sign == 'neg' else '>'} 0",
                )
            ax.axvline(math.log(0.8), color="k", linewidth=0.8)
            ax.set_yscale("log")
            ax.set_title(f"{recipe}", fontsize=9)
            ax.set_xlabel("log ratio after one update")
        axes.flat[0].legend(fontsize=6)
        fig.suptitle(
            f"log-ratio histograms, {variant}, {checkpoints[-1]} checkpoint, lr {hist_lr}; line: log 0.8", fontsize=9
        )
        fig.tight_layout()
        written += _save(fig, out_dir, f"mechanism_ratio_hist_{variant}")
    return written
