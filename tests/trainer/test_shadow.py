"""The BF16 shadow's out-of-sample over-clip: a Calibrated Clipping run measures the bounds in force (calibrated on
earlier steps) on the step's tokens; any other FP8 run calibrates on one half of the step and measures the other."""

from __future__ import annotations

import pytest
import torch

from fp8rl import algos
from fp8rl.algos.calibration import CalibratedClipBounds, StandardClipBounds
from fp8rl.config import RunConfig
from fp8rl.trainer.distributed import SINGLE
from fp8rl.trainer.shadow import ShadowComparison

ROWS, LENGTH = 16, 12


def step_tokens(seed: int) -> tuple[torch.Tensor, ...]:
    """(ratio_ref, ratio_fp8, adv, mask, keys) of one shadow step: FP8 noise on top of a BF16 ratio."""
    g = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(ROWS, LENGTH, generator=g) * 0.1
    ratio_fp8 = torch.exp(log_ratio + torch.randn(ROWS, LENGTH, generator=g) * 0.1)
    adv = torch.tensor([-1.0, 1.0] * (ROWS // 2))
    return torch.exp(log_ratio), ratio_fp8, adv, torch.ones(ROWS, LENGTH, dtype=torch.bool), torch.arange(ROWS)


def finished(policy, seed: int, calibrate: bool) -> dict[str, float]:
    shadow = ShadowComparison(lambda batch, recipe: None, RunConfig().algo, SINGLE)
    shadow.add(*step_tokens(seed))
    return shadow.finish(step=3, clip_policy=policy, calibrate=calibrate)


def test_a_calibrated_run_measures_the_bounds_in_force_before_it_recalibrates() -> None:
    policy = CalibratedClipBounds(initial_bounds=(0.7, 1.3), interval=3, ema=0.0)
    metrics = finished(policy, seed=1, calibrate=True)
    ratio_ref, ratio_fp8, adv, mask, _ = step_tokens(1)
    in_force = algos.clip_fraction_metrics(ratio_fp8, adv, mask, 0.7, 1.3)["clip/low_neg"]
    assert metrics["clip/cc_oos_low_neg"] == pytest.approx(float(in_force))
    assert policy.bounds != (0.7, 1.3)  # then it recalibrated on the step


def test_between_calibrations_the_step_only_joins_the_pool() -> None:
    policy = CalibratedClipBounds(interval=10, ema=0.0, pool_neg_tokens=1000)
    finished(policy, seed=2, calibrate=True)  # step 3 < 10: observed, not calibrated
    assert policy.bounds == (0.8, 1.2) and policy.wants_shadow(4)
    assert algos.metrics_to_floats(policy.metrics())["clip/calib_count"] == 0.0


def test_another_fp8_run_calibrates_on_one_half_and_measures_the_other() -> None:
    metrics = finished(StandardClipBounds(), seed=3, calibrate=False)
    assert {"clip/cc_oos_low_neg", "clip/cc_oos_overclip_neg"} <= set(metrics)
    ratio_ref, ratio_fp8, adv, mask, _ = step_tokens(3)
    standard = algos.clip_fraction_metrics(ratio_fp8, adv, mask, 0.8, 1.2)["clip/low_neg"]
    assert metrics["clip/shadow_fp8_low_neg"] == pytest.approx(float(standard))
