"""The job's parts built from the run config (fp8rl.job.parts)."""

from __future__ import annotations

import pytest

from fp8rl.config import RunConfig, flatten, to_dict, with_overrides
from fp8rl.job.parts import build_clip_policy
from fp8rl.report.frames import schedule_windows

CALIBRATED = {"precision.mode": "fp8_full", "clipping.policy": "calibrated", "clipping.interval": 5}


@pytest.mark.parametrize(("first_step", "first_calibration"), [(None, 5), (0, 0), (2, 2)])
def test_the_calibration_schedule_reaches_the_clip_policy(first_step: int | None, first_calibration: int) -> None:
    cfg = with_overrides(RunConfig(), {**CALIBRATED, "clipping.first_step": first_step, "clipping.init_low": 0.6})
    policy = build_clip_policy(cfg.algo, cfg.clipping)
    calibrating = [step for step in range(12) if policy.needs_calibration(step)]
    assert calibrating[0] == first_calibration
    assert policy.bounds.low == 0.6


@pytest.mark.parametrize("first_step", [None, 0, 3])
def test_the_tables_split_where_the_policy_first_calibrates(first_step: int | None) -> None:
    """The report's window (from the logged params) agrees with the policy: a calibration on step index f is
    logged at step f + 1 and in force from the next logged step."""
    cfg = with_overrides(RunConfig(), {**CALIBRATED, "clipping.first_step": first_step})
    policy = build_clip_policy(cfg.algo, cfg.clipping)
    first_calibration = min(step for step in range(50) if policy.needs_calibration(step))
    params = {key: str(value) for key, value in flatten(to_dict(cfg)).items()}
    assert schedule_windows(params)["mean_calibrated_bounds"][0] == first_calibration + 2
