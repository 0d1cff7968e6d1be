"""The job's parts built from the run config (fp8rl.job.parts)."""

from __future__ import annotations

import pytest

from fp8rl.config import RunConfig, with_overrides
from fp8rl.job.parts import build_clip_policy

CALIBRATED = {"precision.mode": "fp8_full", "clipping.policy": "calibrated", "clipping.interval": 5}


@pytest.mark.parametrize(("first_step", "first_calibration"), [(None, 5), (0, 0), (2, 2)])
def test_the_calibration_schedule_reaches_the_clip_policy(first_step: int | None, first_calibration: int) -> None:
    cfg = with_overrides(RunConfig(), {**CALIBRATED, "clipping.first_step": first_step, "clipping.init_low": 0.6})
    policy = build_clip_policy(cfg.algo, cfg.clipping)
    calibrating = [step for step in range(12) if policy.needs_calibration(step)]
    assert calibrating[0] == first_calibration
    assert policy.bounds.low == 0.6
