"""The 2026-12-01 collapse study's pre-registered rules, applied to finished runs (``make collapse-reject``).

The design, the endpoints and the rules below were committed (results/studies/2026-12-01-collapse.md) before any
run; this module only evaluates them, so the verdicts are computed, never typed:

- ``pilot``: the learning rate by the noise-to-signal criterion: per pilot lr, the mean over its steps of
  BF16's log-ratio spread (``clip/shadow_ref_log_ratio_std``) and of FP8's noise floor
  (``clip/shadow_fp8_noise_std``); the chosen lr is the largest whose spread is at or below its noise floor
  (the smallest when none is);
- ``control``: whether the positive control (BF16 with synthetic over-clipping) accumulates junk: its
  ``rollout/junk_token_rate`` over its last 50 steps at least twice that of BF16 (same seed, same steps) and
  at least 0.002 higher;
- ``verdict``: the endpoints per run (E1 junk rate over the last 50 steps, E2 entropy surge, E3 BF16-evaluated
  accuracy averaged over the last 3 evaluations) and whether "the consequence appears" and "Calibrated
  Clipping recovers" by the rules of results/studies/2026-12-01-collapse.md.

Each writes a Markdown file into the results folder (``collapse_pilot.md``, ``collapse_control.md``,
``collapse_verdict.md``) with the MLflow run ids it read.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from fp8rl.report.frames import RunData, load_runs, reduce_values, run_seed, t_interval
from fp8rl.tracking import store

JUNK = "rollout/junk_token_rate"
SIGNAL, NOISE = "clip/shadow_ref_log_ratio_std", "clip/shadow_fp8_noise_std"
ENTROPY, ACCURACY = "rollout/entropy", "eval/bf16/accuracy"
LAST_STEPS = 50  # E1 and the control's window
CONTROL_MIN_RISE = 0.002
ARMS = {"bf16": "bf16", "vanilla": "fp8_tensorwise_kv", "cc": "cc_tensorwise_kv"}
CONTROL_ARM = "control_overclip"
STOPPED = 3  # exit code of `control --gate` when the control shows nothing: the study is not run


def window_mean(run: RunData, key: str, last: int = LAST_STEPS, until: int | None = None) -> float:
    """Mean of `key` over the run's last `last` logged steps (those at or before `until` when given)."""
    points = sorted((s, v) for s, v in run.history.get(key, []) if until is None or s <= until)
    values = [v for _, v in points[-last:]]
    return statistics.fmean(values) if values else float("nan")


# ---------------------------------------------------------------------------------------------------- pilot
def pilot_frame(runs: Sequence[RunData]) -> pd.DataFrame:
    """One row per pilot lr: mean signal and noise over its steps, whether the criterion holds."""
    rows = []
    for run in runs:
        signal = statistics.fmean(run.series(SIGNAL)) if run.series(SIGNAL) else float("nan")
        noise = statistics.fmean(run.series(NOISE)) if run.series(NOISE) else float("nan")
        seconds = run.series("time/step")
        rows.append(
            {
                "lr": float(run.params.get("algo.lr", "nan")),
                "BF16 log-ratio spread": signal,
                "FP8 noise floor": noise,
                "spread <= noise": bool(signal <= noise),
                "steps": len(run.series(SIGNAL)),
                "s/step": statistics.fmean(seconds) if seconds else float("nan"),
                "run_id": run.run_id,
            }
        )
    return pd.DataFrame(rows).sort_values("lr").reset_index(drop=True)


def choose_lr(frame: pd.DataFrame) -> float:
    """The largest lr that meets the criterion, else the smallest."""
    meeting = frame[frame["spread <= noise"]]
    return float(meeting["lr"].max() if len(meeting) else frame["lr"].min())


# ---------------------------------------------------------------------------------------------------- control
@dataclass(frozen=True)
class ControlResult:
    steps: int
    control_junk: float
    bf16_junk: float
    accumulates: bool


def control_result(control: RunData, bf16: RunData) -> ControlResult:
    """The pre-registered control rule over the control's last 50 steps and BF16's same steps."""
    steps = max(s for s, _ in control.history[JUNK])
    ours, theirs = window_mean(control, JUNK), window_mean(bf16, JUNK, until=steps)
    accumulates = ours >= 2 * theirs and ours - theirs >= CONTROL_MIN_RISE
    return ControlResult(steps, ours, theirs, accumulates)


# ---------------------------------------------------------------------------------------------------- verdict
def endpoints(run: RunData) -> dict[str, float]:
    """E1 junk rate over the last 50 steps, E2 surge (0/1) and its ratio, E3 BF16-evaluated accuracy (last 3)."""
    entropy = run.series(ENTROPY)
    return {
        "E1 junk": window_mean(run, JUNK),
        "E2 surged": reduce_values(entropy, "surged"),
        "E2 surge ratio": reduce_values(entropy, "surge_ratio"),
        "E3 acc (BF16 eval, last 3)": reduce_values(run.series(ACCURACY), "last3"),
        "steps": float(len(entropy)),
    }


def endpoint_frame(runs: Sequence[RunData]) -> pd.DataFrame:
    rows = [{"arm": run.group[0], "seed": run_seed(run), "run_id": run.run_id, **endpoints(run)} for run in runs]
    return pd.DataFrame(rows)


def _by_seed(frame: pd.DataFrame, arm: str, column: str) -> dict[str, float]:
    part = frame[frame["arm"] == ARMS[arm]]
    return dict(zip(part["seed"], part[column], strict=True))


def consequence(frame: pd.DataFrame) -> dict[str, bool]:
    """Which endpoints show the consequence (vanilla FP8 vs BF16, paired by seed), by the pre-registered rules."""
    bf16_junk, van_junk = _by_seed(frame, "bf16", "E1 junk"), _by_seed(frame, "vanilla", "E1 junk")
    seeds = sorted(set(bf16_junk) & set(van_junk))
    junk = bool(seeds) and all(van_junk[s] > bf16_junk[s] for s in seeds)
    junk = junk and statistics.fmean(van_junk[s] for s in seeds) >= 2 * statistics.fmean(bf16_junk[s] for s in seeds)
    van_surged = _by_seed(frame, "vanilla", "E2 surged")
    surge = sum(v == 1.0 for v in van_surged.values()) >= 2 and not any(
        v == 1.0 for v in _by_seed(frame, "bf16", "E2 surged").values()
    )
    _, _, high = _paired_interval(frame, "vanilla", "bf16")
    return {"E1 junk": junk, "E2 surge": surge, "E3 accuracy": bool(high < 0)}


def recovery(frame: pd.DataFrame, appeared: dict[str, bool]) -> dict[str, bool | None]:
    """Whether CC recovers on each endpoint where the consequence appeared (None: not assessable)."""
    out: dict[str, bool | None] = {k: None for k in appeared}
    if appeared["E1 junk"]:
        cc, van, bf16 = (_by_seed(frame, arm, "E1 junk") for arm in ("cc", "vanilla", "bf16"))
        seeds = sorted(set(cc) & set(van) & set(bf16))
        out["E1 junk"] = all(cc[s] < van[s] for s in seeds) and statistics.fmean(
            cc[s] for s in seeds
        ) <= 1.5 * statistics.fmean(bf16[s] for s in seeds)
    if appeared["E2 surge"]:
        out["E2 surge"] = not any(v == 1.0 for v in _by_seed(frame, "cc", "E2 surged").values())
    if appeared["E3 accuracy"]:
        _, _, high = _paired_interval(frame, "cc", "bf16")  # includes 0 or lies above it: not entirely below
        mean_vs_vanilla, _, _ = _paired_interval(frame, "cc", "vanilla")
        out["E3 accuracy"] = bool(not high < 0 and mean_vs_vanilla > 0)
    return out


def _paired_interval(frame: pd.DataFrame, arm: str, reference: str) -> tuple[float, float, float]:
    ours, theirs = (_by_seed(frame, a, "E3 acc (BF16 eval, last 3)") for a in (arm, reference))
    return t_interval([ours[s] - theirs[s] for s in sorted(set(ours) & set(theirs))])


# ---------------------------------------------------------------------------------------------------- CLI
def _header(what: str, runs: Sequence[RunData], uri: str) -> str:
    shas = sorted({r.tags.get("git_sha", "?")[:10] for r in runs})
    return (
        f"{what}: {len(runs)} finished run(s) from MLflow `{store.display_uri(uri)}` at git {', '.join(shas)}; "
        f"generated {time.strftime('%Y-%m-%d %H:%M %Z')} by `python -m fp8rl.studies.collapse`; rules in "
        "results/studies/2026-12-01-collapse.md (committed before the runs)."
    )


def write_pilot(experiment: str, out: Path, uri: str | None) -> Path:
    runs, _, uri = load_runs(experiment, [SIGNAL, NOISE, "time/step"], group_by=["algo.lr"], tracking_uri=uri)
    frame = pilot_frame(runs)
    text = [
        _header("Collapse study pilot (vanilla FP8 tensorwise + FP8 KV cache, seed 0)", runs, uri),
        "",
        frame.to_markdown(index=False, floatfmt=".4g"),
        "",
        f"Chosen lr (largest with spread <= noise, else the smallest): {choose_lr(frame):g}",
    ]
    path = out / "collapse_pilot.md"
    path.write_text("\n".join(text) + "\n")
    return path


def write_control(control_experiment: str, out: Path, uri: str | None) -> tuple[Path, ControlResult]:
    """The control and a BF16 run of the same seed and length (the study's BF16 seed 0 up to that step: the
    learning rate is constant, so the two are the same run up to there)."""
    found, _, uri = load_runs(control_experiment, [JUNK], group_by=["arm"], tracking_uri=uri)
    controls = [r for r in found if r.group[0] == CONTROL_ARM]
    bf16 = (
        [r for r in found if r.group[0] == ARMS["bf16"] and run_seed(r) == run_seed(controls[-1])] if controls else []
    )
    if not controls or not bf16:
        raise SystemExit(f"{control_experiment} needs a finished control run and a BF16 run of the same seed")
    result = control_result(controls[-1], bf16[-1])
    text = [
        _header("Collapse study positive control", [controls[-1], bf16[-1]], uri),
        "",
        f"- control run `{controls[-1].run_id}`, {result.steps} steps; BF16 run `{bf16[-1].run_id}` (same seed)",
        f"- junk token rate over the control's last {LAST_STEPS} steps: {result.control_junk:.4f}; BF16 over the "
        f"same steps: {result.bf16_junk:.4f}",
        f"- accumulates junk (>= 2x and >= {CONTROL_MIN_RISE} higher): **{'yes' if result.accumulates else 'no'}**",
    ]
    path = out / "collapse_control.md"
    path.write_text("\n".join(text) + "\n")
    return path, result


def write_verdict(experiment: str, out: Path, uri: str | None) -> Path:
    runs, _, uri = load_runs(experiment, [JUNK, ENTROPY, ACCURACY], group_by=["arm"], tracking_uri=uri)
    frame = endpoint_frame(runs)
    appeared = consequence(frame)
    recovered = recovery(frame, appeared)
    rows = [{"endpoint": k, "consequence appears": appeared[k], "CC recovers": recovered[k]} for k in appeared]
    text = [
        _header("Collapse study endpoints", runs, uri),
        "",
        frame.to_markdown(index=False, floatfmt=".4f"),
        "",
        pd.DataFrame(rows).to_markdown(index=False),
        "",
        "`CC recovers` is None where the consequence did not appear (not assessable).",
    ]
    path = out / "collapse_verdict.md"
    path.write_text("\n".join(text) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("pilot", "control", "verdict"))
    parser.add_argument("--scale", default="tiny")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tracking-uri", default=None)
    parser.add_argument(
        "--gate",
        action="store_true",
        help="control: exit 3 when the control does not accumulate junk (the study stops there, as pre-registered)",
    )
    args = parser.parse_args(argv)
    out = args.out or Path("results") / args.scale
    out.mkdir(parents=True, exist_ok=True)
    experiment = f"collapse-{args.scale}"
    if args.what == "pilot":
        path = write_pilot(f"collapse_pilot-{args.scale}", out, args.tracking_uri)
    elif args.what == "control":
        path, result = write_control(f"collapse_control-{args.scale}", out, args.tracking_uri)
        if args.gate and not result.accumulates:
            print(
                f"wrote {path}\nThe positive control did not accumulate junk: by the pre-registered rule the task "
                "cannot show the consequence and the study stops here (results/studies/2026-12-01-collapse.md)."
            )
            return STOPPED
    else:
        path = write_verdict(experiment, out, args.tracking_uri)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
