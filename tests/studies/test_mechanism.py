"""The mechanism study's per-cell measurements on synthetic tokens (the study itself runs in `make mechanism`)."""

from __future__ import annotations

import pytest
import torch

from fp8rl.studies.mechanism import Cell, MechanismConfig, Tokens, cell_metrics, histograms, noise_scan_cells

EPS = (0.2, 0.2)


def synthetic_tokens(noise: float, update: float, seed: int = 0, n: int = 4000, batches: int = 2) -> Tokens:
    """`batches` batches of n / batches one-token sequences: BF16 log-ratios ~ update * A-aligned drift; FP8 adds
    independent noise of std `noise`."""
    gen = torch.Generator().manual_seed(seed)
    tokens = Tokens()
    for _ in range(batches):
        size = n // batches
        adv = torch.where(torch.rand(size, generator=gen) < 0.5, -1.0, 1.0)
        true = (update * adv + 0.5 * update * torch.randn(size, generator=gen))[:, None]
        fp8 = true + noise * torch.randn(size, 1, generator=gen)
        mask = torch.ones(size, 1, dtype=torch.long)
        tokens.add(torch.exp(fp8), torch.exp(true), adv, torch.full((size, 1), noise), mask)
    return tokens


def test_noise_over_a_small_update_over_clips_and_calibration_restores_the_count() -> None:
    m = cell_metrics(synthetic_tokens(noise=0.15, update=0.02), EPS)
    assert m["clip/ref_low_neg"] == 0.0 and m["clip/low_neg"] > 0.01
    assert m["clip/overclip_neg"] == m["clip/low_neg"] and m["clip/overlap_precision"] == 0.0
    # out of sample (calibrated on the other batch, where BF16 clips none): CC's bound sits just below that
    # batch's smallest FP8 ratio, so it clips (over-clips) only the rare held-out token below it
    assert m["cc/overclip_neg"] == m["cc/low_neg"] < 0.1 * m["clip/low_neg"]
    assert m["cc/neg_tokens"] == m["mech/neg_tokens"]  # each batch held out once
    assert m["cc/low"] < 0.8 and m["mech/log_ratio_std"] > 3 * m["mech/ref_log_ratio_std"]


def test_calibrated_clipping_is_measured_out_of_sample() -> None:
    # A large update with noise: BF16 clips some tokens; CC calibrated on batch 0 does not hit batch 1's count
    # exactly (out of sample), unlike the in-sample quantile that matches it by construction.
    m = cell_metrics(synthetic_tokens(noise=0.1, update=0.2, n=600), EPS)
    assert m["clip/ref_low_neg"] > 0.05 and m["cc/low_neg"] != m["clip/ref_low_neg"]
    assert abs(m["cc/low_neg"] - m["clip/ref_low_neg"]) < 0.05
    with pytest.raises(ValueError, match="at least 2 batches"):
        cell_metrics(synthetic_tokens(noise=0.1, update=0.2, batches=1), EPS)


def test_without_noise_fp8_and_bf16_clip_the_same_tokens() -> None:
    m = cell_metrics(synthetic_tokens(noise=0.0, update=0.3), EPS)
    assert m["clip/low_neg"] == m["clip/ref_low_neg"] > 0
    assert m["clip/overclip_neg"] == m["clip/underclip_neg"] == 0.0
    assert m["clip/overlap_precision"] == m["clip/overlap_recall"] == 1.0
    assert abs(m["cc/p"] - m["clip/ref_p"]) < 0.05  # out of sample: close, not equal


def test_histograms_split_by_sign_on_fixed_edges() -> None:
    h = histograms(synthetic_tokens(noise=0.05, update=0.05))
    assert len(h["edges"]) == 61 and {"fp8_neg", "fp8_pos", "bf16_neg", "bf16_pos"} <= set(h)
    assert sum(h["fp8_neg"]) + sum(h["fp8_pos"]) == 4000


def test_cell_names_and_the_key() -> None:
    assert Cell("none", "late", "full", "tensorwise", 1e-5).name == "none-late-full-tensorwise-lr1e-05"
    scan = noise_scan_cells(MechanismConfig())
    assert [c.variant for c in scan[:3]] == ["none", "outliers4x32", "outliers4x1024"] and len(scan) == 12
    base = MechanismConfig()
    assert base.key() == MechanismConfig(lrs=(1e-3,), out_dir="elsewhere").key()  # sweeps/outputs: same runs
    assert base.key() != MechanismConfig(batches=3).key() != MechanismConfig(outlier_method="x").key()
