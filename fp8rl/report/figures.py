"""Figures from MLflow: training curves per table (one figure each) and the mechanism study's plots.

Training curves: one line per arm (a group of the sweep's axes), the mean over its seeds at each step with
a band of ± one sample standard deviation (no band for a single seed). Colour says the FP8 recipe, line
style the method (BF16 / FP8 rollout / vanilla FP8 / FP8 + Calibrated Clipping); arms that share both (an
ablation's K or initial bounds) get lighter shades of the colour. Every panel has a y-label with its unit;
titles carry the experiment's name and run count, never a machine's path. Each figure is written as PNG
and PDF and attached to the sweep's parent run in MLflow (artifact folder ``figures/``).
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from fp8rl.report.frames import RunData, load_runs
from fp8rl.report.mechanism import MECH_ORDER, load_mechanism
from fp8rl.report.tables import compare_name
from fp8rl.tracking import store as runs


@dataclass(frozen=True)
class Panel:
    """One axes of the curve figure: metric keys (drawn solid, then dashed), a title and a y-label with unit."""

    title: str
    keys: tuple[str, ...]
    ylabel: str
    limits: tuple[float, float] | None = None  # the values the metric can take (a share: 0-1): the band is cut there


SHARE, NONNEGATIVE = (0.0, 1.0), (0.0, math.inf)
CURVE_PANELS = (
    Panel("rollout entropy", ("rollout/entropy",), "entropy (nats / token)", limits=NONNEGATIVE),
    Panel("rollout reward", ("rollout/reward",), "mean reward (share correct)"),
    Panel("held-out accuracy", ("eval/accuracy",), "accuracy (share correct)", limits=SHARE),
    Panel("garbled rollouts", ("rollout/garbled_rate",), "garbled (share of rollouts)", limits=SHARE),
    Panel("clipped negative tokens (clip/low_neg)", ("clip/low_neg",), "share of A < 0 tokens", limits=SHARE),
    Panel("clip bounds: lower (< 1) and upper (> 1)", ("clip/bound_low", "clip/bound_high"), "bound (ratio)"),
    Panel("update balance p = contrib_pos / contrib_neg", ("clip/p",), "p (ratio)"),
    Panel("response length", ("rollout/response_len",), "tokens", limits=NONNEGATIVE),
)
METHOD_STYLE = {  # method -> (line style of the first key, legend name)
    "bf16": ("-", "BF16"),
    "fp8_rollout": (":", "FP8 rollout"),
    "fp8": ("--", "vanilla FP8"),
    "cc": ("-", "FP8 + CC"),
}
RECIPE_COLOR = {"none": "black", "tensorwise": "tab:blue", "rowwise": "tab:orange", "blockwise": "tab:green",
                "mxfp8": "tab:purple"}  # fmt: skip
STEP_LABEL = "RL step"


def method_of(tags: dict[str, str]) -> str:
    """bf16, fp8_rollout, fp8 (vanilla full-pipeline FP8) or cc (FP8 + Calibrated Clipping), from run tags."""
    precision = tags.get("precision", "")
    if precision in ("bf16", "fp8_rollout"):
        return precision
    return "cc" if tags.get("clipping") == "calibrated" else "fp8"


@dataclass(frozen=True)
class ArmStyle:
    color: Any
    linestyle: str
    label: str


def arm_styles(groups: dict[tuple[str, ...], list[RunData]], group_by: Sequence[str]) -> dict[tuple, ArmStyle]:
    """A colour (recipe), line style (method) and legend label per arm; shades for arms sharing both."""
    from matplotlib.colors import to_rgb

    seen: dict[tuple[str, str], int] = {}
    styles = {}
    for group, members in groups.items():
        tags = members[0].tags
        method, recipe = method_of(tags), tags.get("recipe", "none")
        shade = seen[(method, recipe)] = seen.get((method, recipe), -1) + 1
        base = to_rgb(RECIPE_COLOR.get(recipe, "tab:gray"))
        color = tuple(c + (1 - c) * min(0.25 * shade, 0.75) for c in base)  # lighter for each further arm
        linestyle, method_name = METHOD_STYLE[method]
        recipe_name = "" if method == "bf16" else f" {recipe}"
        axes = ", ".join(f"{compare_name(k)}={v}" for k, v in zip(group_by, group, strict=True) if v)
        styles[group] = ArmStyle(color, linestyle, f"{method_name}{recipe_name} ({axes}; {len(members)} seeds)")
    return styles


def seed_band(members: Sequence[RunData], key: str) -> pd.DataFrame:
    """Per step: mean, sample std (NaN for one seed) and n over the members' finite values of `key`."""
    rows = [(step, value) for run in members for step, value in run.history.get(key, []) if math.isfinite(value)]
    frame = pd.DataFrame(rows, columns=["step", "value"])
    return frame.groupby("step")["value"].agg(["mean", "std", "count"]).reset_index()


def _draw_panel(ax: Any, panel: Panel, groups: dict, styles: dict[tuple, ArmStyle]) -> None:
    drawn = False
    for group, members in groups.items():
        style = styles[group]
        for key in panel.keys:  # several keys (the two bounds) share the arm's style: they never overlap
            band = seed_band(members, key)
            if band.empty:
                continue
            drawn = True
            ax.plot(band["step"], band["mean"], linestyle=style.linestyle, color=style.color, linewidth=1.4)
            if (band["count"] > 1).any():
                spread = band["std"].fillna(0.0)
                low, high = band["mean"] - spread, band["mean"] + spread
                if panel.limits is not None:
                    low, high = low.clip(*panel.limits), high.clip(*panel.limits)
                ax.fill_between(band["step"], low, high, color=style.color, alpha=0.15, linewidth=0)
    if not drawn:
        ax.text(0.5, 0.5, "not logged by these runs", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel(STEP_LABEL)
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)


def curve_figure(experiment: str, run_data: list[RunData], group_by: Sequence[str]) -> Any:
    """The training-curve figure of one table's runs (module docstring)."""
    from matplotlib.lines import Line2D

    groups: dict[tuple[str, ...], list[RunData]] = {}
    for run in run_data:
        groups.setdefault(run.group, []).append(run)
    styles = arm_styles(groups, group_by)
    plt = _plt()
    fig, axes = plt.subplots(2, 4, figsize=(20, 8.5))
    for ax, panel in zip(axes.flat, CURVE_PANELS, strict=True):
        _draw_panel(ax, panel, groups, styles)
    handles = [Line2D([], [], color=s.color, linestyle=s.linestyle, label=s.label) for s in styles.values()]
    fig.legend(handles=handles, loc="lower center", ncol=min(4, len(handles)), fontsize=8, frameon=False)
    fig.suptitle(
        f"{experiment}: mean over seeds, band ± 1 sd ({len(run_data)} runs); colour = FP8 recipe, "
        "line style = method (BF16 solid black, FP8 rollout dotted, vanilla FP8 dashed, FP8 + CC solid)",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.04 + 0.025 * math.ceil(len(handles) / 4), 1, 0.96))
    return fig


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


def attach_to_parent(experiment: str, paths: Sequence[Path], tracking_uri: str | None) -> str | None:
    """Log `paths` as artifacts (``figures/``) of the sweep's parent run; its run id, or None without one."""
    client = runs.client(runs.absolute_tracking_uri(tracking_uri))
    exp_id = runs.experiment_id(client, experiment, create=False)
    parent = runs.find_parent(client, exp_id, experiment) if exp_id is not None else None
    if parent is None:
        return None
    for path in paths:
        client.log_artifact(parent.info.run_id, str(path), "figures")
    return parent.info.run_id


def training_curves(experiment: str, out_dir: Path, tracking_uri: str | None = None) -> list[Path]:
    keys = [key for panel in CURVE_PANELS for key in panel.keys]
    run_data, group_by, _ = load_runs(experiment, keys, tracking_uri=tracking_uri, newest_only=True)  # as the tables
    if not run_data:
        return []
    written = _save(curve_figure(experiment, run_data, group_by), out_dir, f"{experiment}_curves")
    attach_to_parent(experiment, written, tracking_uri)
    return written


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
            ax.set_ylabel("tokens")
        axes.flat[0].legend(fontsize=6)
        fig.suptitle(
            f"log-ratio histograms, {variant}, {checkpoints[-1]} checkpoint, lr {hist_lr}; line: log 0.8", fontsize=9
        )
        fig.tight_layout()
        written += _save(fig, out_dir, f"mechanism_ratio_hist_{variant}")
    return written
