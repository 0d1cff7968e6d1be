"""`make demo`: BF16 vs vanilla full-pipeline FP8 vs FP8 + Calibrated Clipping on the tiny task.

The three arms are the paper tables' arm files (``sweeps/experiment/arm/{bf16,fp8_tensorwise,cc_tensorwise}``
at ``scale=tiny``: token TIS in every arm, the same smoothing), composed exactly as a sweep composes them,
with fewer steps and the shortest recalibration interval of the tables' ablation (K = 2), so that
Calibrated Clipping acts within the demo. Each arm is one MLflow run (experiment ``fp8rl-demo``, sqlite
``./mlflow.db``); a re-run finds finished arms in MLflow and only prints their summary. Ends with a table
(outputs/demo/summary.{md,csv}), what each calibration did, what to look at, and what a one-seed run of a
few steps cannot show.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp8rl._warnings import silence_expected_warnings
from fp8rl.report.frames import Column
from fp8rl.tracking.glossary import CALIBRATION_RULES

ARMS = ("bf16", "fp8_tensorwise", "cc_tensorwise")
DEMO_OVERRIDES = (  # what the demo changes from the tiny tables' setting, and why
    "trainer.steps={steps}",  # a few minutes on a 2-core CPU
    # Recalibrate every 2 steps: the shortest interval of the tables' recalibration ablation (tiny K = 2/5/10;
    # the tables' default is 5 of 40 steps), so Calibrated Clipping calibrates 7 times in 15 steps.
    "clipping.interval=2",
    "trainer.shadow_every=2",  # the BF16 shadow on the same steps in the vanilla FP8 arm: its over-clip measured
    "eval.every=5",
)
EXPERIMENT = "fp8rl-demo"
SUMMARY = (
    Column("final eval accuracy", "eval/accuracy", "last"),
    Column("mean reward", "rollout/reward", "mean"),
    Column("peak rollout entropy", "rollout/entropy", "max"),
    Column("clip/low_neg (mean)", "clip/low_neg", "mean", "{:.4f}"),
    Column("over-clip at standard bounds (neg, mean)", "clip/shadow_overclip_neg", "mean", "{:.4f}"),
    Column("over-clip at own bounds (neg, mean)", "clip/overclip_neg", "mean", "{:.4f}"),
    Column("bound_low (min)", "clip/bound_low", "min"),
    Column("bound_low (last)", "clip/bound_low", "last"),
    Column("bound_high (last)", "clip/bound_high", "last"),
    Column("s/step", "time/step", "mean", "{:.2f}"),
)
WHAT_TO_LOOK_AT = """\
What to look at (every key is explained in docs/metrics.md):
- clip/low_neg: the share of negative-advantage tokens whose gradient PPO's clip zeroes. FP8 noise in both
  log-probs inflates it (vanilla FP8 vs BF16); Calibrated Clipping aims to bring it back to BF16's.
- the BF16 shadow: on shadow steps both FP8 arms recompute the ratios in BF16 on the same tokens.
  over-clip at standard bounds (clip/shadow_overclip_neg) is the share of negative tokens FP8 clips at
  0.8 / 1.2 that BF16 would not; over-clip at own bounds (clip/overclip_neg) is the same at the bounds the
  arm trains with: Calibrated Clipping aims to lower it. BF16 has no shadow (its cells are empty).
- clip/bound_low / clip/bound_high: where Calibrated Clipping moved the bounds (BF16 and vanilla FP8 keep
  0.8 / 1.2); the calibration lines above say which rule fired at each calibration (clip/calib_* in MLflow).
The FP8 and FP8 + CC arms start from the same weights and seeds: their steps are identical until the first
calibration moves a bound, so every later difference between the two comes from the bounds.
What this run cannot show: one seed and {steps} steps of a tiny model are far from the paper's hundreds of
steps on 8B-32B models. With one seed a difference in accuracy, reward or entropy cannot be told apart from
seed noise (the tables run 3 seeds and report mean +- sd), and the paper's consequence (entropy surges,
garbled output) needs long runs: see results/README.md."""


def demo_overrides(arm: str, steps: int, experiment: str = EXPERIMENT) -> list[str]:
    """The arm's overrides. Another `experiment` is a demo apart (its own MLflow experiment and run folders), e.g.
    the same arms under other CPU kernels (``fp8rl.studies.kernel_spread``): the config hash is the same."""
    where = [] if experiment == EXPERIMENT else [f"trainer.out_dir=outputs/{experiment}/{arm}"]
    return [
        "scale=tiny",
        f"+experiment/arm={arm}",
        *(o.format(steps=steps) for o in DEMO_OVERRIDES),
        f"tracking.experiment={experiment}",
        *where,
    ]


@dataclass(frozen=True)
class CalibrationEvent:
    """One calibration of a run: its step, the rules that fired (``ok`` or CalibStatus flags) and the bounds
    in force after it."""

    step: int
    fired: tuple[str, ...]
    low: float
    high: float

    def line(self) -> str:
        return f"  step {self.step}: {', '.join(self.fired)} -> bounds {self.low:.3f}/{self.high:.3f}"


def calibration_events(client: Any, run_id: str) -> list[CalibrationEvent]:
    """The run's calibrations, read back from its ``clip/calib_<flag>`` and bound histories in MLflow."""
    run = client.get_run(run_id)
    by_step: dict[int, dict[str, float]] = {}
    keys = [f"clip/calib_{flag}" for flag in CALIBRATION_RULES] + ["clip/bound_low", "clip/bound_high"]
    for key in (k for k in keys if k in run.data.metrics):
        for metric in client.get_metric_history(run_id, key):
            by_step.setdefault(metric.step, {})[key] = metric.value
    events = []
    for step, values in sorted(by_step.items()):
        fired = tuple(flag for flag in CALIBRATION_RULES if values.get(f"clip/calib_{flag}") == 1.0)
        if fired:
            events.append(CalibrationEvent(step, fired, values["clip/bound_low"], values["clip/bound_high"]))
    return events


def rule_legend(events: list[CalibrationEvent]) -> list[str]:
    """What each rule that fired means (from the metric glossary)."""
    fired = dict.fromkeys(flag for event in events for flag in event.fired)
    return [f"  {flag}: {CALIBRATION_RULES[flag]}" for flag in fired]


def calibration_summary(events: list[CalibrationEvent]) -> str:
    """``"7 calibrations: ok 5, alpha_zero 2"`` (a calibration may fire more than one rule)."""
    if not events:
        return "-"
    counts = Counter(flag for event in events for flag in event.fired)
    return f"{len(events)} calibrations: " + ", ".join(f"{flag} {n}" for flag, n in counts.most_common())


def arm_header(index: int, arm: str) -> str:
    """``[demo 1/3] bf16`` in bold, as rich markup (the bracketed counter escaped: rich would read it as a tag)."""
    from rich.markup import escape

    return f"[bold]{escape(f'[demo {index}/{len(ARMS)}]')} {arm}[/bold]"


def demo_numbers(frame: Any) -> dict[str, float | None]:
    """From the summary (one row per arm of `ARMS`): each arm's mean clip/low_neg (``low_neg/<arm>``) and each
    FP8 arm's over-clip at its own bounds (``own/<arm>``); None where never logged."""
    rows = frame.set_index("run")

    def value(arm: str, column: str) -> float | None:
        found = rows.at[arm, column] if arm in rows.index and column in rows.columns else None
        return None if found is None or found != found else float(found)  # NaN: never logged

    numbers = {f"low_neg/{arm}": value(arm, "clip/low_neg (mean)") for arm in ARMS}
    numbers.update({f"own/{arm}": value(arm, "over-clip at own bounds (neg, mean)") for arm in ARMS[1:]})
    return numbers


def demo_verdicts(frame: Any) -> dict[str, bool | None]:
    """The demo's three directions (None: not measured): FP8 noise inflated clip/low_neg over BF16's; Calibrated
    Clipping lowered the over-clip at its own bounds below vanilla FP8's; CC's clip/low_neg below vanilla FP8's."""
    n = demo_numbers(frame)

    def below(a: float | None, b: float | None) -> bool | None:
        return None if a is None or b is None else a < b

    return {
        "fp8_inflates_low_neg": below(n["low_neg/bf16"], n["low_neg/fp8_tensorwise"]),
        "cc_lowers_overclip": below(n["own/cc_tensorwise"], n["own/fp8_tensorwise"]),
        "cc_low_neg_below_fp8": below(n["low_neg/cc_tensorwise"], n["low_neg/fp8_tensorwise"]),
    }


def what_this_run_showed(frame: Any) -> str:
    """The demo's own numbers read back (`demo_verdicts`) in words, with the numbers. One seed: a direction, not
    a test."""
    n, verdicts = demo_numbers(frame), demo_verdicts(frame)
    bf16, fp8, cc = (n[f"low_neg/{arm}"] for arm in ARMS)
    lines = ["What this run showed (one seed, so a direction, not a test):"]
    if verdicts["fp8_inflates_low_neg"] is None:
        lines.append("- clip/low_neg was not logged by every arm: nothing to compare.")
    else:
        verdict = "inflated" if verdicts["fp8_inflates_low_neg"] else "did not inflate"
        lines.append(f"- FP8 noise {verdict} clip/low_neg: vanilla FP8 {fp8:.4f} against BF16's {bf16:.4f}.")
    if verdicts["cc_lowers_overclip"] is None:
        lines.append("- the over-clip at own bounds was not measured in both FP8 arms (no shadow step ran).")
    else:
        verdict = "lowered" if verdicts["cc_lowers_overclip"] else "did not lower"
        lines.append(
            f"- Calibrated Clipping {verdict} the over-clip at its own bounds: {n['own/cc_tensorwise']:.4f} against "
            f"vanilla FP8's {n['own/fp8_tensorwise']:.4f}."
        )
    if verdicts["cc_low_neg_below_fp8"] is not None:
        verdict = "below" if verdicts["cc_low_neg_below_fp8"] else "not below"
        lines.append(f"- its clip/low_neg was {verdict} vanilla FP8's: {cc:.4f} against {fp8:.4f}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=15, help="RL steps per arm")
    parser.add_argument("--out", type=Path, default=Path("outputs/demo"), help="the summary's folder")
    parser.add_argument("--experiment", default=EXPERIMENT, help="the MLflow experiment (another: a demo apart)")
    args = parser.parse_args(argv)
    silence_expected_warnings()
    from rich.console import Console

    from fp8rl.choices import validated
    from fp8rl.compose import compose_config
    from fp8rl.job import run_job
    from fp8rl.report.tables import summarize_runs, write_frame
    from fp8rl.tracking import store

    console = Console(soft_wrap=True)  # a pipe or a log file gets whole lines
    run_ids = {}
    for index, arm in enumerate(ARMS, start=1):
        console.print(arm_header(index, arm))
        cfg = validated(compose_config(demo_overrides(arm, args.steps, args.experiment)))
        run_ids[arm] = run_job(cfg).run_id
    uri = store.absolute_tracking_uri(cfg.tracking.tracking_uri)
    frame = summarize_runs(run_ids, SUMMARY, tracking_uri=uri)
    client = store.client(uri)
    events = {arm: calibration_events(client, run_id) for arm, run_id in run_ids.items() if run_id}
    frame["calibrations"] = [calibration_summary(events.get(arm, [])) for arm in frame["run"]]
    frame = frame.astype(object).where(frame.notna(), None)  # a metric an arm never logs: an empty cell, not nan
    written = write_frame(frame, args.out, "summary", title="fp8rl demo (tiny task, CPU, one seed)")
    (args.out / "runs.json").write_text(json.dumps(run_ids, indent=2) + "\n")  # {arm: MLflow run id}
    console.print(frame.to_markdown(index=False, floatfmt=".4f"))
    for arm, arm_events in events.items():
        if arm_events:
            console.print(f"Calibrated Clipping in {arm} ({calibration_summary(arm_events)}):")
            console.print("\n".join(event.line() for event in arm_events), highlight=False)
            console.print("\n".join(["The rules:", *rule_legend(arm_events)]), highlight=False)
    console.print(WHAT_TO_LOOK_AT.format(steps=args.steps))
    console.print(what_this_run_showed(frame), highlight=False)
    console.print(
        f"summary: {', '.join(str(p) for p in written)}; MLflow: `make mlflow-ui`, experiment {args.experiment}"
    )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # one line, not a traceback
        print(
            "interrupted (Ctrl-C): the arm that was training is marked KILLED; `make demo` resumes it", file=sys.stderr
        )
        sys.exit(130)
