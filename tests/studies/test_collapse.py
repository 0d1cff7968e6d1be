"""The collapse study's pre-registered rules on synthetic runs (fp8rl.studies.collapse)."""

from __future__ import annotations

import pandas as pd
import pytest

from fp8rl.report.frames import RunData
from fp8rl.studies import collapse as c


def run(arm: str, seed: int, junk: float = 0.01, entropy: list[float] | None = None, acc: float = 0.6) -> RunData:
    entropy = entropy or [0.5] * 300
    history = {
        c.JUNK: [(s, junk if s > 250 else 0.01) for s in range(1, 301)],
        c.ENTROPY: list(enumerate(entropy, 1)),
        c.ACCURACY: [(s, acc) for s in (0, 50, 100, 150, 200, 250, 300)],
    }
    return RunData(f"{arm}{seed}", arm, (arm,), {}, {"trainer.seed": str(seed)}, history)


def frame(vanilla_junk=(0.01, 0.01, 0.01), vanilla_acc=(0.6, 0.6, 0.6), cc_junk=(0.01,) * 3, cc_acc=(0.6,) * 3):
    runs = [run("bf16", s, 0.01, acc=0.6 + 0.01 * s) for s in range(3)]
    runs += [run("fp8_tensorwise_kv", s, vanilla_junk[s], acc=vanilla_acc[s] + 0.01 * s) for s in range(3)]
    runs += [run("cc_tensorwise_kv", s, cc_junk[s], acc=cc_acc[s] + 0.01 * s) for s in range(3)]
    return c.endpoint_frame(runs)


def test_no_consequence_and_nothing_to_recover() -> None:
    f = frame()
    assert f["E1 junk"].tolist() == pytest.approx([0.01] * 9)
    appeared = c.consequence(f)
    assert appeared == {"E1 junk": False, "E2 surge": False, "E3 accuracy": False}
    assert c.recovery(f, appeared) == {"E1 junk": None, "E2 surge": None, "E3 accuracy": None}


def test_junk_consequence_needs_every_seed_and_twice_the_mean() -> None:
    assert c.consequence(frame(vanilla_junk=(0.03, 0.03, 0.03)))["E1 junk"]
    assert not c.consequence(frame(vanilla_junk=(0.05, 0.05, 0.009)))["E1 junk"]  # one seed below BF16
    assert not c.consequence(frame(vanilla_junk=(0.015, 0.015, 0.015)))["E1 junk"]  # < 2x
    junk_only = {"E1 junk": True, "E2 surge": False, "E3 accuracy": False}
    assert c.recovery(frame(vanilla_junk=(0.03,) * 3, cc_junk=(0.012,) * 3), junk_only)["E1 junk"] is True
    # lower than vanilla but above 1.5x BF16: not recovered
    assert c.recovery(frame(vanilla_junk=(0.03,) * 3, cc_junk=(0.02,) * 3), junk_only)["E1 junk"] is False


def test_accuracy_consequence_by_the_paired_interval() -> None:
    f = frame(vanilla_acc=(0.5, 0.49, 0.51))
    assert c.consequence(f)["E3 accuracy"]
    assert c.recovery(f, c.consequence(f))["E3 accuracy"] is True  # CC equals BF16 per seed
    worse = frame(vanilla_acc=(0.5, 0.49, 0.51), cc_acc=(0.45, 0.44, 0.46))
    assert c.recovery(worse, c.consequence(worse))["E3 accuracy"] is False
    assert not c.consequence(frame(vanilla_acc=(0.5, 0.7, 0.6)))["E3 accuracy"]


def test_surge_consequence() -> None:
    surge = [0.5] * 150 + [1.5] * 150
    runs = [run("bf16", s) for s in range(3)] + [run("fp8_tensorwise_kv", s, entropy=surge) for s in range(2)]
    runs += [run("fp8_tensorwise_kv", 2), *(run("cc_tensorwise_kv", s) for s in range(3))]
    f = c.endpoint_frame(runs)
    assert c.consequence(f)["E2 surge"] and c.recovery(f, c.consequence(f))["E2 surge"] is True


def test_control_rule_and_pilot_choice() -> None:
    control, bf16 = run("control_overclip", 0, junk=0.02), run("bf16", 0, junk=0.005)
    result = c.control_result(control, bf16)
    assert result.accumulates and (result.control_junk, result.bf16_junk) == pytest.approx((0.02, 0.005))
    assert not c.control_result(run("control_overclip", 0, junk=0.009), bf16).accumulates  # < 2x
    tiny = run("bf16", 0, junk=0.0005)
    assert not c.control_result(run("control_overclip", 0, junk=0.0015), tiny).accumulates  # 3x but < 0.002 higher
    pilot = pd.DataFrame({"lr": [3e-6, 1e-5, 3e-5], "spread <= noise": [True, True, False]})
    assert c.choose_lr(pilot) == 1e-5
    assert c.choose_lr(pilot.assign(**{"spread <= noise": False})) == 3e-6


@pytest.mark.parametrize(("accumulates", "code"), [(False, c.STOPPED), (True, 0)])
def test_the_study_stops_when_the_control_shows_nothing(accumulates, code, tmp_path, monkeypatch) -> None:
    result = c.ControlResult(117, 0.02 if accumulates else 0.0001, 0.0001, accumulates)
    monkeypatch.setattr(c, "write_control", lambda *a: (tmp_path / "collapse_control.md", result))
    assert c.main(["control", "--gate", "--out", str(tmp_path)]) == code
    assert c.main(["control", "--out", str(tmp_path)]) == 0  # without --gate only the report is written
