"""An RL step on a GPU: vLLM FP8 rollout, Transformer Engine FP8 training (gpu marker; skipped on CPU)."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="needs transformer_engine"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (pip install 'fp8rl[gpu]')"),
]


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_rl_step_with_vllm_fp8_rollout_and_te_fp8_training(small_cfg, recipe) -> None:
    from fp8rl.config import with_overrides
    from fp8rl.job import build_trainer

    cfg = with_overrides(
        small_cfg,
        {
            "model.device": "cuda",
            "precision.mode": "fp8_full",
            "precision.recipe": recipe,
            "precision.backend": "te",
            "rollout.engine": "vllm",
            "clipping.policy": "calibrated",  # the BF16 shadow passes run too
            "clipping.interval": 1,
            "clipping.rollout_correction": "tis_token",
        },
    )
    trainer = build_trainer(cfg)
    try:
        before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)}
        result = trainer.train_step(1)
        after = trainer.model.state_dict()
    finally:
        trainer.engine.close()
    m = result.metrics
    assert result.good
    assert all(math.isfinite(v) for v in m.values())
    assert 1.0 <= m["rollout/token_mult_prob_error"] < 1.1  # vLLM FP8 vs the TE FP8 trainer
    assert "clip/overclip_neg" in m and "clip/calib_alpha_low" in m
    assert any(not torch.equal(before[k], after[k]) for k in before if k in after)
