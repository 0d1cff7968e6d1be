"""The junk organism's pre-registered rules, applied to finished runs (``make collapse``: ``junk-gate``,
``junk-dose``, ``junk-arms``).

The design and each rule were committed (results/studies/2026-12-06-junk-organism.md) before the runs they judge;
this module only evaluates the rules, so the verdicts are computed, never typed:

- ``gate``: the positive control (BF16 with every negative-advantage junk token's gradient removed,
  ``clipping.synthetic_drop_neg=1``) passes if its junk-mass probe (``eval/junk_mass``, the mean of its last 3
  evaluations) is at least twice BF16's (same seed) and above its own value at step 0;
- ``dose``: per arm, the per-seed differences of that junk mass against BF16 (same seed), mean and 95%
  t-interval; the dose-response holds if the means rise with q (0.1 < 0.3 < 1.0) and q = 1.0's interval
  excludes 0; untargeted removal of the same count (``control_dropother``) leaves junk alone if its interval
  includes 0, and targeting matters if besides q = 1.0's difference exceeds it in every seed.

- ``arms``: the FP8 arms' four endpoints (amended before their runs): the prediction (each FP8 arm's junk-mass
  difference from BF16 has a 95% t-interval including 0, and no FP8 run's rollout entropy surged); FP8's dose on
  junk (vanilla FP8's over-clip share of negative-advantage junk tokens pooled over seeds and shadow steps, with a
  95% Wilson interval; the prediction's premise holds if it lies below q = 0.1); Calibrated Clipping's recovery
  (junk mass below vanilla FP8's in every seed and a lower pooled junk over-clip share); and whether negative
  tokens are over-clipped disproportionately (the A < 0 share's interval above the A > 0 share's), with the
  shares per token class and p_old bucket.

Each writes a Markdown file into the results folder (``junk_gate.md``, ``junk_dose.md``, ``junk_arms.md``) with
the MLflow run ids it read; ``gate --stop`` exits 3 when the gate does not pass (the study stops there, as
pre-registered).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from scipy import stats

from fp8rl.algos import p_old_bucket_names
from fp8rl.report.frames import RunData, load_runs, reduce_values, run_seed, t_interval
from fp8rl.report.surge import detect_surge
from fp8rl.tracking import store

JUNK_MASS = "eval/junk_mass"
BF16_ARM, CONTROL_ARM = "bf16", "control_dropjunk"
GATE_FACTOR = 2.0
DOSES = {"control_dropjunk_q10": 0.1, "control_dropjunk_q30": 0.3, "control_dropjunk": 1.0}  # arm -> q
UNTARGETED_ARM = "control_dropother"
VANILLA_ARM, CC_ARM = "fp8_tensorwise_kv", "cc_tensorwise_kv"
FP8_ARMS = (VANILLA_ARM, CC_ARM)
SMALLEST_DOSE = min(DOSES.values())
ENTROPY = "rollout/entropy"
TOKEN_CLASSES = ("junk", "digit", "separator", "eos", "other")  # the chain task's (`ChainTask.token_classes`)
GROUPS = (*TOKEN_CLASSES, *p_old_bucket_names())
SIGNS = {"neg": "A<0 (lower bound)", "pos": "A>0 (upper bound)"}
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


def arm_intervals(differences: pd.DataFrame) -> pd.DataFrame:
    """Per arm of `junk_differences`: n, the mean difference from BF16 and its 95% t-interval over the seeds."""
    summary = []
    for arm, rows in differences.groupby("arm", sort=False):
        mean, low, high = t_interval(rows["minus BF16"].tolist())
        summary.append({"arm": arm, "n": len(rows), "mean": mean, "low": low, "high": high})
    return pd.DataFrame(summary)


def dose_verdict(differences: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, bool]]:
    """Per arm: n, mean difference and its 95% t-interval; and the two pre-registered verdicts (module docstring)."""
    table = arm_intervals(differences)
    table.insert(1, "q", table["arm"].map(DOSES))
    table = table.sort_values("q", na_position="last", kind="stable")
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


def count_keys(sign: str, group: str) -> tuple[str, str, str]:
    """The shadow steps' count metrics of one sign and group: (tokens, over-clipped, under-clipped)."""
    tail = f"{sign}_{group}"
    return f"clip/count/{tail}", f"clip/count/overclip_{tail}", f"clip/count/underclip_{tail}"


def pooled_shares(runs: Sequence[RunData], sign: str, group: str) -> dict[str, float]:
    """FP8's clipping error of one sign and group (``all``: every token, the p_old buckets summed, a partition)
    pooled over `runs` and their shadow steps as ratios of sums: tokens, over- and under-clipped shares, the
    over-clip share's 95% Wilson interval, and the net share."""
    parts = p_old_bucket_names() if group == "all" else [group]
    n, over, under = (
        round(sum(sum(r.series(count_keys(sign, part)[i])) for r in runs for part in parts)) for i in range(3)
    )
    if n == 0:
        return dict.fromkeys(("tokens", "over-clip", "low", "high", "under-clip", "net"), math.nan) | {"tokens": 0}
    interval = stats.binomtest(over, n).proportion_ci(method="wilson")
    return {
        "tokens": n,
        "over-clip": over / n,
        "low": interval.low,
        "high": interval.high,
        "under-clip": under / n,
        "net": (over - under) / n,
    }


def breakdown(runs: Sequence[RunData]) -> pd.DataFrame:
    """`pooled_shares` per FP8 arm, sign and group (all tokens, the token classes, the p_old buckets)."""
    rows = [
        {"arm": arm, "sign": sign, "group": group, **pooled_shares([r for r in runs if r.group[0] == arm], sign, group)}
        for arm in FP8_ARMS
        for sign in SIGNS
        for group in ("all", *GROUPS)
    ]
    return pd.DataFrame(rows)


def surges(runs: Sequence[RunData]) -> pd.DataFrame:
    """Per run: its arm, seed, rollout-entropy surge ratio and whether it surged (`fp8rl.report.surge`)."""
    rows = []
    for r in runs:
        surge = detect_surge(r.series(ENTROPY))
        rows.append({"arm": r.group[0], "seed": run_seed(r), "surge ratio": surge.ratio, "surged": surge.surged})
    return pd.DataFrame(rows)


def arms_verdicts(
    differences: pd.DataFrame, shares: pd.DataFrame, surged: pd.DataFrame
) -> tuple[pd.DataFrame, dict[str, bool]]:
    """The four pre-registered endpoints of the FP8 arms (module docstring): the per-arm t-intervals of the
    junk-mass differences and the verdicts."""
    table = arm_intervals(differences).set_index("arm")
    includes_zero = all(arm in table.index and table.loc[arm, "low"] <= 0 <= table.loc[arm, "high"] for arm in FP8_ARMS)
    fp8_surged = bool(surged[surged["arm"].isin(FP8_ARMS)]["surged"].any())

    def share(arm: str, sign: str, group: str) -> pd.Series:
        return shares[(shares["arm"] == arm) & (shares["sign"] == sign) & (shares["group"] == group)].iloc[0]

    dose = share(VANILLA_ARM, "neg", "junk")
    pairs = differences.pivot(index="seed", columns="arm", values="junk mass")
    cc_lower_every_seed = bool((pairs[CC_ARM] < pairs[VANILLA_ARM]).all())
    cc_lower_dose = bool(share(CC_ARM, "neg", "junk")["over-clip"] < dose["over-clip"])
    neg, pos = share(VANILLA_ARM, "neg", "all"), share(VANILLA_ARM, "pos", "all")
    verdicts = {
        "the prediction holds (both FP8 arms' intervals include 0, no FP8 run surged)": includes_zero
        and not fp8_surged,
        f"FP8's dose on junk lies below q = {SMALLEST_DOSE:g} (its Wilson interval)": bool(
            dose["high"] < SMALLEST_DOSE
        ),
        "Calibrated Clipping recovers (junk mass below vanilla FP8's in every seed and a lower junk over-clip share)": (
            cc_lower_every_seed and cc_lower_dose
        ),
        "vanilla FP8 over-clips negative tokens disproportionately (A<0 interval above A>0's)": bool(
            neg["low"] > pos["high"]
        ),
    }
    return table.reset_index(), verdicts


def write_arms(experiment: str, out: Path, uri: str | None) -> Path:
    """The FP8 arms' endpoints: junk-mass differences, surges, FP8's pooled clipping error, the verdicts."""
    keys = [JUNK_MASS, ENTROPY, *(k for sign in SIGNS for group in GROUPS for k in count_keys(sign, group))]
    runs, _, uri = load_runs(experiment, keys, group_by=["arm"], tracking_uri=uri, newest_only=True)
    differences = junk_differences(runs)
    if differences.empty or not set(FP8_ARMS) <= set(differences["arm"]):
        raise SystemExit(f"{experiment} needs finished BF16, {VANILLA_ARM} and {CC_ARM} runs of the same seeds")
    shares, surged = breakdown(runs), surges(runs)
    table, verdicts = arms_verdicts(differences, shares, surged)
    sections = [
        "Junk mass (probe, mean of the last 3 evaluations) and its difference from BF16's of the same seed:",
        "",
        differences.to_markdown(index=False, floatfmt=".5f"),
        "",
        "Per FP8 arm, mean difference and 95% t-interval over the seeds:",
        "",
        table.to_markdown(index=False, floatfmt=".5f"),
        "",
        "Rollout-entropy surges (`fp8rl/report/surge.py`):",
        "",
        surged.to_markdown(index=False, floatfmt=".3f"),
        "",
        "FP8's clipping error against the BF16 shadow, pooled over the seeds' shadow steps (ratios of sums of "
        "`clip/count/...`; sign neg: A<0 tokens at the lower bound, pos: A>0 tokens at the upper bound; `low`, "
        "`high`: the over-clip share's 95% Wilson interval, tokens treated as independent, so descriptive; groups: "
        "token classes and p_old buckets in percent):",
        "",
        shares.to_markdown(index=False, floatfmt=".4f"),
        "",
    ]
    return _write_report(out / "junk_arms.md", runs, uri, "the FP8 arms", sections, verdicts)


def _write_report(
    path: Path, runs: Sequence[RunData], uri: str, what: str, sections: list[str], verdicts: dict[str, bool]
) -> Path:
    """A verdict file: the header, the sections, the verdicts as yes/no lines, and the run ids read."""
    ids = ", ".join(f"`{r.run_id}` ({r.group[0]}, seed {run_seed(r)})" for r in runs)
    verdict_lines = [f"- {name}: **{'yes' if value else 'no'}**" for name, value in verdicts.items()]
    text = [_header(runs, uri, what), "", *sections, *verdict_lines, "", f"Runs: {ids}."]
    path.write_text("\n".join(text) + "\n")
    return path


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
    sections = [
        "Junk mass (probe, mean of the last 3 evaluations) minus BF16's of the same seed:",
        "",
        differences.to_markdown(index=False, floatfmt=".5f"),
        "",
        "Per arm, mean and 95% t-interval over the seeds:",
        "",
        table.to_markdown(index=False, floatfmt=".5f"),
        "",
    ]
    what = "the dose-response and the targeting control"
    return _write_report(out / "junk_dose.md", runs, uri, what, sections, verdicts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("gate", "dose", "arms"))
    parser.add_argument("--scale", default="tiny")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tracking-uri", default=None)
    parser.add_argument("--stop", action="store_true", help="exit 3 when the gate does not pass")
    args = parser.parse_args(argv)
    out = args.out or Path("results") / args.scale
    out.mkdir(parents=True, exist_ok=True)
    if args.what in ("dose", "arms"):
        write = write_dose if args.what == "dose" else write_arms
        print(f"wrote {write(f'junk_{args.what}-{args.scale}', out, args.tracking_uri)}")
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
