"""`make demo`: its arms are the tables' arm files, and it reads each calibration back from MLflow in words."""

from __future__ import annotations

from pathlib import Path

from fp8rl.choices import validated
from fp8rl.compose import compose_config
from fp8rl.demo import ARMS, CalibrationEvent, calibration_events, calibration_summary, demo_overrides, rule_legend
from fp8rl.tracking import store


def test_the_arms_differ_only_in_precision_and_clipping_policy_and_all_run_tis() -> None:
    configs = {arm: validated(compose_config(demo_overrides(arm, steps=15))) for arm in ARMS}
    assert {cfg.clipping.rollout_correction for cfg in configs.values()} == {"tis_token"}
    assert len({cfg.clipping.ema for cfg in configs.values()}) == 1  # the same smoothing in every arm
    assert [(c.precision.mode, c.clipping.policy) for c in configs.values()] == [
        ("bf16", "standard"), ("fp8_full", "standard"), ("fp8_full", "calibrated")]  # fmt: skip
    cc = configs["cc_tensorwise"]
    assert cc.clipping.interval < cc.trainer.steps // 2 and cc.trainer.steps == 15  # several calibrations


def test_calibrations_are_read_back_with_the_rules_that_fired(tmp_path: Path) -> None:
    from mlflow.entities import Metric

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = store.client(uri)
    run_id = client.create_run(store.experiment_id(client, "demo", create=True)).info.run_id
    logged = {  # step -> the step's metrics (a calibration step logs every clip/calib_<rule>)
        2: {"clip/bound_low": 0.8, "clip/bound_high": 1.2},
        3: {"clip/calib_ok": 1.0, "clip/calib_alpha_zero": 0.0, "clip/bound_low": 0.69, "clip/bound_high": 1.2},
        5: {"clip/calib_ok": 0.0, "clip/calib_alpha_zero": 1.0, "clip/calib_p_unreachable": 1.0,
            "clip/bound_low": 0.72, "clip/bound_high": 1.19},
    }  # fmt: skip
    client.log_batch(run_id, metrics=[Metric(k, v, 0, step) for step, m in logged.items() for k, v in m.items()])
    events = calibration_events(client, run_id)
    assert events == [
        CalibrationEvent(3, ("ok",), 0.69, 1.2),
        CalibrationEvent(5, ("alpha_zero", "p_unreachable"), 0.72, 1.19),
    ]
    assert events[1].line() == "  step 5: alpha_zero, p_unreachable -> bounds 0.720/1.190"
    assert calibration_summary(events) == "2 calibrations: ok 1, alpha_zero 1, p_unreachable 1"
    assert rule_legend(events)[1].startswith("  alpha_zero: BF16 clipped no negative token")


def test_the_arm_header_shows_its_bracketed_counter() -> None:
    """rich read ``[demo 1/3]`` as a markup tag and printed only the arm's name."""
    import io

    from rich.console import Console

    from fp8rl.demo import arm_header

    console = Console(file=io.StringIO(), soft_wrap=True)
    console.print(arm_header(1, "bf16"))
    assert console.file.getvalue() == "[demo 1/3] bf16\n"


def test_the_summary_reads_the_runs_own_numbers_back_in_words() -> None:
    """The demo explained what Calibrated Clipping should do, never whether it did in this run."""
    import pandas as pd

    from fp8rl.demo import what_this_run_showed

    frame = pd.DataFrame(
        {
            "run": ["bf16", "fp8_tensorwise", "cc_tensorwise"],
            "clip/low_neg (mean)": [0.0024, 0.0405, 0.0407],
            "over-clip at own bounds (neg, mean)": [None, 0.012, 0.003],
        }
    )
    text = what_this_run_showed(frame)
    assert "FP8 noise inflated clip/low_neg: vanilla FP8 0.0405 against BF16's 0.0024" in text
    assert "Calibrated Clipping lowered the over-clip at its own bounds: 0.0030 against vanilla FP8's 0.0120" in text
    assert "its clip/low_neg was not below vanilla FP8's: 0.0407 against 0.0405" in text
    frame.loc[2, "over-clip at own bounds (neg, mean)"] = 0.02
    assert "did not lower" in what_this_run_showed(frame)
    assert "nothing to compare" in what_this_run_showed(frame.drop(columns="clip/low_neg (mean)"))
