"""The junk organism's pre-registered gate, applied to finished runs (``make junk-gate``).

The design and the rule were committed (results/studies/2026-12-06-junk-organism.md) before any run; this module
only evaluates the rule, so the verdict is computed, never typed:

- ``gate``: the positive control (BF16 with every negative-advantage junk token's gradient removed,
  ``clipping.synthetic_drop_neg=1``) passes if its junk-mass probe (``eval/junk_mass``, the mean of its last 3
  evaluations) is at least twice BF16's (same seed) and above its own value at step 0;
- ``dose``: per arm, the per-seed differences of that junk mass against BF16 (same seed), mean and 95%
  t-interval; the dose-response holds if the means rise with q (0.1 < 0.3 < 1.0) and q = 1.0's interval
  excludes 0; untargeted removal of the same count (``control_dropother``) leaves junk alone if its interval
  includes 0, and targeting matters if besides q = 1.0's difference exceeds it in every seed.

Each writes a Markdown file into the results folder (``junk_gate.md``, ``junk_dose.md``) with the MLflow run ids
it read; ``gate --stop`` exits 3 when the gate does not pass (the study stops there, as pre-registered).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from fp8rl.report.frames import RunData, load_runs, reduce_values, run_seed, t_interval
from fp8rl.tracking import store

JUNK_MASS = "eval/junk_mass"
BF16_ARM, CONTROL_ARM = "bf16", "control_dropjunk"
GATE_FACTOR = 2.0
DOSES = {"control_dropjunk_q10": 0.1, "control_dropjunk_q30": 0.3, "control_dropjunk": 1.0}  # arm -> q
UNTARGETED_ARM = "control_dropother"
STOPPED = 3  # exit code of `gate --stop` when the gate does not pass: the study is not run further


@dataclass(frozen=True)
class GateResult:
    control_start: float  # the control's junk mass at step 0
    control_end: float  # ... the mean of its last 3 evaluations
    bf16_end: float  # BF16's (same seed), the mean of its last 3 evaluations
    passed: bool


def gate_result(control: RunData, bf16: RunData) -> GateResult:
    """The pre-registered gate rule (module docstring)."""
    start, end = reduce_values(control.series(JUNK_MASS), "first"), reduce_values(control.series(JUNK_MASS), "last3")
    reference = reduce_values(bf16.series(JUNK_MASS), "last3")
    return GateResult(start, end, reference, end >= GATE_FACTOR * reference and end > start)


def junk_differences(runs: Sequence[RunData]) -> pd.DataFrame:
    """One row per (arm, seed) of the non-BF16 arms: the junk mass (last 3 evaluations) and its difference from
    BF16's of the same seed."""
    ends = {(r.group[0], run_seed(r)): reduce_values(r.series(JUNK_MASS), "last3") for r in runs}
    rows = [
        {"arm": arm, "seed": seed, "junk mass": value, "minus BF16": value - ends[(BF16_ARM, seed)]}
        for (arm, seed), value in sorted(ends.items())
        if arm != BF16_ARM and (BF16_ARM, seed) in ends
    ]
    return pd.DataFrame(rows, columns=["arm", "seed", "junk mass", "minus BF16"])


def dose_verdict(differences: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, bool]]:
    """Per arm: n, mean difference and its 95% t-interval; and the two pre-registered verdicts (module docstring)."""
    summary = []
    for arm, rows in differences.groupby("arm", sort=False):
        mean, low, high = t_interval(rows["minus BF16"].tolist())
        summary.append({"arm": arm, "q": DOSES.get(arm), "n": len(rows), "mean": mean, "low": low, "high": high})
    table = pd.DataFrame(summary).sort_values("q", na_position="last", kind="stable")
    by_arm = table.set_index("arm")
    means = [by_arm.loc[arm, "mean"] for arm in DOSES if arm in by_arm.index]
    full = by_arm.loc["control_dropjunk"] if "control_dropjunk" in by_arm.index else None
    rises = len(means) == len(DOSES) and all(a < b for a, b in zip(means, means[1:], strict=False))
    dose_response = bool(rises and full is not None and full["low"] > 0)
    other = by_arm.loc[UNTARGETED_ARM] if UNTARGETED_ARM in by_arm.index else None
    count_alone = bool(other is not None and other["low"] <= 0 <= other["high"])
    pairs = differences.pivot(index="seed", columns="arm", values="minus BF16")
    every_seed = bool(
        other is not None and full is not None and (pairs["control_dropjunk"] > pairs[UNTARGETED_ARM]).all()
    )
    verdicts = {
        "dose-response holds": dose_response,
        "the same count untargeted leaves junk alone": count_alone,
        "targeting matters": count_alone and every_seed,
    }
    return table, verdicts


def _header(runs: Sequence[RunData], uri: str, what: str = "the gate") -> str:
    shas = sorted({r.tags.get("git_sha", "?")[:10] for r in runs})
    return (
        f"Junk organism, {what}: {len(runs)} finished run(s) from MLflow `{store.display_uri(uri)}` at git "
        f"{', '.join(shas)}; generated {time.strftime('%Y-%m-%d %H:%M %Z')} by "
        "`python -m fp8rl.studies.junk_organism`; rule in results/studies/2026-12-06-junk-organism.md "
        "(committed before the runs)."
    )


def write_gate(experiment: str, out: Path, uri: str | None) -> tuple[Path, GateResult]:
    """The control and the BF16 run of the same seed, the rule's numbers and its verdict."""
    found, _, uri = load_runs(experiment, [JUNK_MASS], group_by=["arm"], tracking_uri=uri)
    controls = [r for r in found if r.group[0] == CONTROL_ARM]
    bf16 = [r for r in found if r.group[0] == BF16_ARM and controls and run_seed(r) == run_seed(controls[-1])]
    if not controls or not bf16:
        raise SystemExit(f"{experiment} needs a finished {CONTROL_ARM} run and a {BF16_ARM} run of the same seed")
    control, reference = controls[-1], bf16[-1]
    result = gate_result(control, reference)
    text = [
        _header([control, reference], uri),
        "",
        f"- control run `{control.run_id}` ({CONTROL_ARM}), BF16 run `{reference.run_id}`, seed {run_seed(control)}",
        f"- junk mass (probe) of the control: {result.control_start:.5f} at step 0, {result.control_end:.5f} over "
        f"its last 3 evaluations; BF16's over its last 3: {result.bf16_end:.5f} "
        f"(ratio {result.control_end / result.bf16_end:.2f})",
        f"- the gate (>= {GATE_FACTOR:g}x BF16's and above its own start): "
        f"**{'passed' if result.passed else 'not passed'}**",
    ]
    path = out / "junk_gate.md"
    path.write_text("\n".join(text) + "\n")
    return path, result


def write_dose(experiment: str, out: Path, uri: str | None) -> Path:
    """The dose-response and the targeting control: per-seed differences, their intervals, the verdicts."""
    runs, _, uri = load_runs(experiment, [JUNK_MASS], group_by=["arm"], tracking_uri=uri)
    differences = junk_differences(runs)
    if differences.empty:
        raise SystemExit(f"{experiment} needs finished BF16 runs and removal runs of the same seeds")
    table, verdicts = dose_verdict(differences)
    ids = ", ".join(f"`{r.run_id}` ({r.group[0]}, seed {run_seed(r)})" for r in runs)
    text = [
        _header(runs, uri, "the dose-response and the targeting control"),
        "",
        "Junk mass (probe, mean of the last 3 evaluations) minus BF16's of the same seed:",
        "",
        differences.to_markdown(index=False, floatfmt=".5f"),
        "",
        "Per arm, mean and 95% t-interval over the seeds:",
        "",
        table.to_markdown(index=False, floatfmt=".5f"),
        "",
        *(f"- {name}: **{'yes' if value else 'no'}**" for name, value in verdicts.items()),
        "",
        f"Runs: {ids}.",
    ]
    path = out / "junk_dose.md"
    path.write_text("\n".join(text) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("gate", "dose"))
    parser.add_argument("--scale", default="tiny")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tracking-uri", default=None)
    parser.add_argument("--stop", action="store_true", help="exit 3 when the gate does not pass")
    args = parser.parse_args(argv)
    out = args.out or Path("results") / args.scale
    out.mkdir(parents=True, exist_ok=True)
    if args.what == "dose":
        print(f"wrote {write_dose(f'junk_dose-{args.scale}', out, args.tracking_uri)}")
        return 0
    path, result = write_gate(f"junk_gate-{args.scale}", out, args.tracking_uri)
    print(f"wrote {path}")
    if args.stop and not result.passed:
        print(
            "The gate did not pass: by the pre-registered rule the organism cannot express the consequence at this "
            "length, and the study stops here (results/studies/2026-12-06-junk-organism.md)."
        )
        return STOPPED
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
