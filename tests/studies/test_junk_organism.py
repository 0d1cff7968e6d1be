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


def arm_run(arm: str, seed: int, mass: float, counts: dict[str, tuple[int, int, int]], surge: bool = False) -> RunData:
    """A run of the FP8 arms' study: its junk mass over the last 3 evaluations, a flat (or surging) rollout entropy,
    and on two shadow steps half of `counts` each: (sign, group) "neg_junk" -> (tokens, over, under)."""
    history = {j.JUNK_MASS: [(step, 0.02 if step < 200 else mass) for step in range(0, 350, 50)]}
    history[j.ENTROPY] = [(step, 0.4 if not surge or step < 200 else 1.5) for step in range(1, 301)]
    for tail, values in counts.items():
        sign, group = tail.split("_", 1)
        for key, value in zip(j.count_keys(sign, group), values, strict=True):
            history[key] = [(20, value / 2), (40, value / 2)]
    return RunData(f"{arm}{seed}", arm, (arm,), {}, {"trainer.seed": str(seed)}, history)


def arms_runs(vanilla=(0.011, 0.011, 0.009), cc=(0.010, 0.010, 0.008), vanilla_junk=(200, 2, 0), surge=False):
    """BF16 and the two FP8 arms, 3 seeds; FP8's counts: A<0 junk `vanilla_junk` (CC: half the over-clips), A<0 in
    the top p_old bucket 1000 tokens with 20 over-clipped, A>0 1000 with 2."""
    runs = [arm_run("bf16", s, m, {}) for s, m in enumerate(BF16)]
    for arm, masses in ((j.VANILLA_ARM, vanilla), (j.CC_ARM, cc)):
        junk = vanilla_junk if arm == j.VANILLA_ARM else (vanilla_junk[0], vanilla_junk[1] // 2, 0)
        counts = {"neg_junk": junk, "neg_pold_50_100": (1000, 20, 4), "pos_pold_50_100": (1000, 2, 2)}
        runs += [arm_run(arm, s, m, counts, surge and arm == j.VANILLA_ARM) for s, m in enumerate(masses)]
    return runs


def verdicts_of(runs: list[RunData]) -> dict[str, bool]:
    verdicts = j.arms_verdicts(j.junk_differences(runs), j.breakdown(runs), j.surges(runs))[1]
    return dict(zip("pdcn", verdicts.values(), strict=True))


def test_the_fp8_arms_endpoints_on_a_null_outcome() -> None:
    """FP8 arms at BF16's junk: the prediction holds; a dose of 1% of 600 junk tokens lies below q = 0.1; CC lowers
    junk in every seed and halves the dose, so it 'recovers'; 2% of A<0 over-clipped against 0.2% of A>0."""
    runs = arms_runs()
    shares = j.breakdown(runs)
    junk = shares[(shares["arm"] == j.VANILLA_ARM) & (shares["sign"] == "neg") & (shares["group"] == "junk")].iloc[0]
    assert (junk["tokens"], junk["over-clip"], junk["net"]) == (600, pytest.approx(0.01), pytest.approx(0.01))
    every = shares[(shares["arm"] == j.VANILLA_ARM) & (shares["group"] == "all")].set_index("sign")
    assert every.loc["neg", "tokens"] == 3000 and every.loc["neg", "over-clip"] == pytest.approx(0.02)
    assert every.loc["neg", "under-clip"] == pytest.approx(0.004)
    assert verdicts_of(runs) == {"p": True, "d": True, "c": True, "n": True}


def test_the_fp8_arms_endpoints_fail_as_designed() -> None:
    assert not verdicts_of(arms_runs(vanilla=(0.30, 0.35, 0.40)))["p"]  # vanilla FP8 raised junk
    assert not verdicts_of(arms_runs(surge=True))["p"]  # an FP8 run surged
    assert not verdicts_of(arms_runs(vanilla_junk=(40, 8, 0)))["d"]  # 20% of A<0 junk over-clipped
    assert not verdicts_of(arms_runs(cc=(0.010, 0.012, 0.008)))["c"]  # CC above vanilla FP8 in seed 1
