"""The BF16 shadow's out-of-sample over-clip: a Calibrated Clipping run measures the bounds in force (calibrated on
earlier steps) on the step's tokens; any other FP8 run calibrates on one half of the step and measures the other."""

from __future__ import annotations

import pytest
import torch

from fp8rl import algos
from fp8rl.algos.calibration import CalibratedClipBounds, StandardClipBounds
from fp8rl.config import RunConfig
from fp8rl.models.dims import SINGLE
from fp8rl.trainer.shadow import ShadowComparison

ROWS, LENGTH = 16, 12


def step_tokens(seed: int) -> tuple[torch.Tensor, ...]:
    """(ratio_ref, ratio_fp8, adv, mask, keys) of one shadow step: FP8 noise on top of a BF16 ratio."""
    g = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(ROWS, LENGTH, generator=g) * 0.1
    ratio_fp8 = torch.exp(log_ratio + torch.randn(ROWS, LENGTH, generator=g) * 0.1)
    adv = torch.tensor([-1.0, 1.0] * (ROWS // 2))
    return torch.exp(log_ratio), ratio_fp8, adv, torch.ones(ROWS, LENGTH, dtype=torch.bool), torch.arange(ROWS)


def finished(policy, seed: int) -> dict[str, float]:
    """The shadow's metrics of a step; the policy says whether it calibrates (`calibrates`)."""
    shadow = ShadowComparison(lambda batch, recipe: None, RunConfig().algo, SINGLE)
    shadow.add(*step_tokens(seed))
    return shadow.finish(step=3, clip_policy=policy)


def test_a_calibrated_run_measures_the_bounds_in_force_before_it_recalibrates() -> None:
    policy = CalibratedClipBounds(initial_bounds=(0.7, 1.3), interval=3, ema=0.0)
    metrics = finished(policy, seed=1)
    ratio_ref, ratio_fp8, adv, mask, _ = step_tokens(1)
    in_force = algos.clip_fraction_metrics(ratio_fp8, adv, mask, 0.7, 1.3)["clip/low_neg"]
    assert metrics["clip/cc_oos_low_neg"] == pytest.approx(float(in_force))
    assert policy.bounds != (0.7, 1.3)  # then it recalibrated on the step


def test_between_calibrations_the_step_only_joins_the_pool() -> None:
    policy = CalibratedClipBounds(interval=10, ema=0.0, pool_neg_tokens=1000)
    finished(policy, seed=2)  # step 3 < 10: observed, not calibrated
    assert policy.bounds == (0.8, 1.2) and policy.wants_shadow(4)
    assert algos.metrics_to_floats(policy.metrics())["clip/calib_count"] == 0.0


def test_another_fp8_run_calibrates_on_one_half_and_measures_the_other() -> None:
    metrics = finished(StandardClipBounds(), seed=3)
    assert {"clip/cc_oos_low_neg", "clip/cc_oos_overclip_neg"} <= set(metrics)
    ratio_ref, ratio_fp8, adv, mask, _ = step_tokens(3)
    standard = algos.clip_fraction_metrics(ratio_fp8, adv, mask, 0.8, 1.2)["clip/low_neg"]
    assert metrics["clip/shadow_fp8_low_neg"] == pytest.approx(float(standard))


def test_the_update_over_clip_is_the_shadows_fp8_at_the_bounds_in_force_against_bf16_at_the_standard_ones():
    """Over the loss's tokens (after the rollout correction's rejection), from the update's own log-probs."""
    ratio_ref, ratio_fp8, adv, mask, _ = step_tokens(4)
    old = -torch.rand(ROWS, LENGTH, generator=torch.Generator().manual_seed(5))
    logp = old + torch.log(ratio_fp8)
    rejected = mask.clone()
    rejected[0] = False
    correction = algos.RolloutCorrection(None, rejected, {})
    tokens = algos.TokenBatch(old, adv, mask, correction)
    metrics = ShadowComparison.overclip(ratio_ref, logp, tokens, (0.85, 1.2), RunConfig().algo)
    expected = algos.overclip_metrics(ratio_ref, torch.exp(logp - old), adv, rejected, 0.85, 1.2, 0.8, 1.2)
    assert metrics["clip/overclip_neg"] == pytest.approx(float(expected["clip/overclip_neg"]), rel=1e-6)
    assert metrics["clip/ref_p"] == pytest.approx(float(expected["clip/ref_p"]), rel=1e-6)
    assert metrics["clip/overclip_neg"] > 0 and "clip/p" not in metrics  # the loss logs FP8's own p
