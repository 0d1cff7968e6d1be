"""The junk organism's pre-registered gate, applied to finished runs (``make junk-gate``).

The design and the rule were committed (results/studies/2026-12-06-junk-organism.md) before any run; this module
only evaluates the rule, so the verdict is computed, never typed:

- ``gate``: the positive control (BF16 with every negative-advantage junk token's gradient removed,
  ``clipping.synthetic_drop_neg=1``) passes if its junk-mass probe (``eval/junk_mass``, the mean of its last 3
  evaluations) is at least twice BF16's (same seed) and above its own value at step 0.

It writes ``junk_gate.md`` into the results folder with the MLflow run ids it read, and exits 3 with ``--stop``
when the gate does not pass (the study stops there, as pre-registered).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fp8rl.report.frames import RunData, load_runs, reduce_values, run_seed
from fp8rl.tracking import store

JUNK_MASS = "eval/junk_mass"
BF16_ARM, CONTROL_ARM = "bf16", "control_dropjunk"
GATE_FACTOR = 2.0
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


def _header(runs: Sequence[RunData], uri: str) -> str:
    shas = sorted({r.tags.get("git_sha", "?")[:10] for r in runs})
    return (
        f"Junk organism, the gate: {len(runs)} finished run(s) from MLflow `{store.display_uri(uri)}` at git "
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("gate",))
    parser.add_argument("--scale", default="tiny")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tracking-uri", default=None)
    parser.add_argument("--stop", action="store_true", help="exit 3 when the gate does not pass")
    args = parser.parse_args(argv)
    out = args.out or Path("results") / args.scale
    out.mkdir(parents=True, exist_ok=True)
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
