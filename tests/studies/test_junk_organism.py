"""The junk organism's pre-registered gate on synthetic runs (fp8rl.studies.junk_organism)."""

from __future__ import annotations

import pytest

from fp8rl.report.frames import RunData
from fp8rl.studies import junk_organism as j


def run(arm: str, masses: list[float], seed: int = 0) -> RunData:
    history = {j.JUNK_MASS: [(step, mass) for step, mass in zip(range(0, 350, 50), masses, strict=False)]}
    return RunData(f"{arm}{seed}", arm, (arm,), {}, {"trainer.seed": str(seed)}, history)


@pytest.mark.parametrize(
    ("control", "passed"),
    [
        ([0.010, 0.012, 0.02, 0.03, 0.04, 0.05, 0.06], True),  # 0.05 >= 2 x 0.01 and above its start
        ([0.010, 0.010, 0.01, 0.01, 0.015, 0.015, 0.015], False),  # 1.5x BF16's
        ([0.050, 0.040, 0.03, 0.03, 0.025, 0.025, 0.025], False),  # 2.5x BF16's, but below its own start
    ],
)
def test_the_gate_needs_twice_bf16s_junk_mass_and_a_rise_over_its_start(control, passed) -> None:
    bf16 = run("bf16", [0.010] * 7)
    result = j.gate_result(run("control_dropjunk", control), bf16)
    assert result.passed is passed
    assert result.bf16_end == pytest.approx(0.010) and result.control_start == control[0]
    assert result.control_end == pytest.approx(sum(control[-3:]) / 3)


def dose_runs(ends: dict[str, list[float]]) -> list[RunData]:
    """One run per (arm, seed) whose last 3 evaluations all have the given junk mass."""
    return [
        run(arm, [0.02, 0.02, 0.02, 0.02, m, m, m], seed)
        for arm, masses in ends.items()
        for seed, m in enumerate(masses)
    ]


BF16 = [0.010, 0.012, 0.008]


def test_the_dose_response_needs_rising_means_and_full_removal_above_bf16() -> None:
    ends = {
        "bf16": BF16,
        "control_dropjunk_q10": [0.011, 0.014, 0.009],
        "control_dropjunk_q30": [0.020, 0.018, 0.015],
        "control_dropjunk": [0.50, 0.55, 0.60],
        "control_dropother": [0.011, 0.011, 0.009],
    }
    differences = j.junk_differences(dose_runs(ends))
    assert len(differences) == 12 and differences["minus BF16"].iloc[0] == pytest.approx(0.49)
    table, verdicts = j.dose_verdict(differences)
    assert table["arm"].tolist()[:3] == ["control_dropjunk_q10", "control_dropjunk_q30", "control_dropjunk"]
    assert verdicts == {
        "dose-response holds": True,
        "the same count untargeted leaves junk alone": True,
        "targeting matters": True,
    }
    flat = {**ends, "control_dropjunk_q30": [0.011, 0.013, 0.009]}  # q = 0.3 below q = 0.1 on average
    assert not j.dose_verdict(j.junk_differences(dose_runs(flat)))[1]["dose-response holds"]
    untargeted = {**ends, "control_dropother": [0.10, 0.12, 0.09]}  # the count alone raises junk too
    verdicts = j.dose_verdict(j.junk_differences(dose_runs(untargeted)))[1]
    assert not verdicts["the same count untargeted leaves junk alone"] and not verdicts["targeting matters"]
