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
