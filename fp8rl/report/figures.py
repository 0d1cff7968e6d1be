"""Figures from MLflow: training curves per table (one figure each) and the mechanism study's plots.

Training curves, as small multiples: one block of axes (a panel per metric) per FP8 recipe, and one for the
BF16-precision arms other than the reference, so that an axes holds a few arms only; the BF16 arm
(`REFERENCE`) is drawn in black in every block, and a metric's axes share their y-range across blocks so that
the blocks compare. Each arm is the mean over its seeds at each step with a band of ± one sample standard
deviation (none for a single seed). Colour and line style both say the method (FP8 rollout purple dotted,
vanilla FP8 red dashed, FP8 + Calibrated Clipping blue solid), the same in every block; arms of one method in
one block (an ablation's K) take the next free colours. Every panel has a y-label with its unit; titles carry
the experiment's name and run count, never a machine's path. Each figure is written as PNG and PDF and attached
to the sweep's parent run in MLflow (artifact folder ``figures/``).
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
from fp8rl.report.tables import REFERENCE_ARM, compare_name
from fp8rl.tracking import store as runs


@dataclass(frozen=True)
class Panel:
    """An axes of each block of the curve figure: metric keys (in the arm's style), a title, a y-label with unit."""

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
    Panel("clip bounds (lower < 1 < upper)", ("clip/bound_low", "clip/bound_high"), "bound (ratio)"),
    Panel("update balance p = pos / neg contribution", ("clip/p",), "p (ratio)"),
    Panel("response length", ("rollout/response_len",), "tokens", limits=NONNEGATIVE),
)
METHOD_STYLE = {  # method -> (line style, legend name)
    "bf16": ("-", "BF16"),
    "fp8_rollout": (":", "FP8 rollout"),
    "fp8": ("--", "vanilla FP8"),
    "cc": ("-", "FP8 + CC"),
}
RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8")  # the blocks' order
BF16_COLUMN = "BF16 arms"  # the block of BF16-precision arms other than the reference (ablations, controls)
REFERENCE = REFERENCE_ARM  # the arm drawn in every block
REFERENCE_COLOR = "black"
METHOD_COLOR = {"bf16": "tab:green", "fp8_rollout": "tab:purple", "fp8": "tab:red", "cc": "tab:blue"}
ARM_COLORS = ("tab:orange", "tab:cyan", "tab:olive", "tab:brown", "tab:pink", "tab:gray")  # after a method's own colour
LINE_NAMES = {"-": "solid", "--": "dashed", ":": "dotted"}
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
    column: str  # the recipe block it is drawn in; `REFERENCE` for the arm drawn in all
    method: str  # `method_of` its runs


def arm_styles(groups: dict[tuple[str, ...], list[RunData]], group_by: Sequence[str]) -> dict[tuple, ArmStyle]:
    """Per arm: its block (the FP8 recipe; `BF16_COLUMN`; `REFERENCE` for the BF16 arm), its method's colour (the
    next free one where a block has several arms of a method, black for the reference), a line style by method and
    a legend label with its seed count."""
    from matplotlib.colors import to_rgb

    taken: dict[str, list[str]] = {}  # block -> colours given in it
    styles = {}
    for group, members in groups.items():
        tags = members[0].tags
        method = method_of(tags)
        recipe = "" if method == "bf16" else tags.get("recipe", "none")
        if _is_reference(group, group_by):
            column, color = REFERENCE, to_rgb(REFERENCE_COLOR)
        else:
            column = recipe or BF16_COLUMN
            used = taken.setdefault(column, [])
            free = [c for c in (METHOD_COLOR[method], *ARM_COLORS) if c not in used] or list(ARM_COLORS)
            used.append(free[0])
            color = to_rgb(free[0])
        linestyle, method_name = METHOD_STYLE[method]
        axes = ", ".join(f"{compare_name(k)}={v}" for k, v in zip(group_by, group, strict=True) if v)
        label = f"{method_name}{f' {recipe}' if recipe else ''} ({axes}; {len(members)} seeds)"
        styles[group] = ArmStyle(color, linestyle, label, column, method)
    return styles


def _is_reference(group: tuple[str, ...], group_by: Sequence[str]) -> bool:
    """The arm named `REFERENCE` on the sweep's arm axis (not any group with a "bf16" value on another axis)."""
    return any(compare_name(key) == "arm" and value == REFERENCE for key, value in zip(group_by, group, strict=True))


def figure_columns(styles: dict[tuple, ArmStyle]) -> list[str]:
    """The figure's blocks (each arm's `ArmStyle.column`): the recipes present in `RECIPES` order, then any other, then
    `BF16_COLUMN`; the reference alone when it is the only arm."""
    present = {s.column for s in styles.values()} - {REFERENCE}
    known = [r for r in RECIPES if r in present]
    others = sorted(present - set(RECIPES) - {BF16_COLUMN})
    return [*known, *others, *([BF16_COLUMN] if BF16_COLUMN in present else [])] or [REFERENCE]


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


PANEL_COLUMNS = 4  # a facet's metrics in rows of this many axes


def curve_figure(experiment: str, run_data: list[RunData], group_by: Sequence[str]) -> Any:
    """The training-curve figure of one table's runs (module docstring)."""
    from matplotlib.lines import Line2D

    groups: dict[tuple[str, ...], list[RunData]] = {}
    for run in run_data:
        groups.setdefault(run.group, []).append(run)
    styles = arm_styles(groups, group_by)
    facets = figure_columns(styles)
    block = math.ceil(len(CURVE_PANELS) / PANEL_COLUMNS)  # axes rows per facet
    plt = _plt()
    fig, axes = plt.subplots(
        block * len(facets),
        PANEL_COLUMNS,
        figsize=(4.6 * PANEL_COLUMNS + 3.4, 3.0 * block * len(facets) + 0.8),
        squeeze=False,
    )
    for index, facet in enumerate(facets):
        shown = {g: m for g, m in groups.items() if styles[g].column in (facet, REFERENCE)}
        for i, panel in enumerate(CURVE_PANELS):
            ax = axes[index * block + i // PANEL_COLUMNS, i % PANEL_COLUMNS]
            _draw_panel(ax, panel, shown, styles)
            if index:  # a metric's axes share their y range across facets, so that the facets compare
                ax.sharey(axes[i // PANEL_COLUMNS, i % PANEL_COLUMNS])
        for ax in axes[index * block + (len(CURVE_PANELS) - 1) // PANEL_COLUMNS + 1 : (index + 1) * block].flat:
            ax.set_axis_off()
        first = axes[index * block, 0]
        first.annotate(
            facet, (-0.3, 1.12), xycoords="axes fraction", ha="left", va="bottom", fontsize=13, weight="bold"
        )
        handles = [
            Line2D([], [], color=styles[g].color, linestyle=styles[g].linestyle, label=styles[g].label) for g in shown
        ]
        anchor = axes[index * block, -1]
        anchor.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.05, 1.0), fontsize=8, frameon=False)
    fig.suptitle(_title(experiment, len(run_data), facets, styles), fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.98), h_pad=2.0)
    return fig


def _title(experiment: str, runs_drawn: int, facets: list[str], styles: dict[tuple, ArmStyle]) -> str:
    """The figure's title: what it shows, and how the methods it draws look."""
    blocks = "one block per FP8 recipe" if any(f in RECIPES for f in facets) else "one block"
    reference = ", BF16 in black in each" if any(s.column == REFERENCE for s in styles.values()) else ""
    drawn = {s.method for s in styles.values() if s.column != REFERENCE}
    methods = [
        f"{METHOD_STYLE[m][1]} {METHOD_COLOR[m].removeprefix('tab:')} {LINE_NAMES[METHOD_STYLE[m][0]]}"
        for m in METHOD_STYLE
        if m in drawn
    ]
    return f"{experiment}: mean over seeds, band ± 1 sd ({runs_drawn} runs); {blocks}{reference}; {', '.join(methods)}"


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
