import math

import pytest
import torch

from fp8rl.algos import (
    clip_fraction_metrics,
    contribution_metrics,
    entropy_from_logits,
    entropy_metrics,
    overclip_metrics,
    ratio_quantile_metrics,
    rollout_mismatch_metrics,
    sign_contributions,
)

# one sequence, 8 tokens; the last is masked out
RATIO = torch.tensor([[0.5, 0.8, 1.0, 1.5, 0.5, 1.0, 1.2, 2.0]])
ADV = torch.tensor([[-1.0, -2.0, -1.0, -1.0, 1.0, 2.0, 1.0, 5.0]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]])


def test_clip_fractions_by_bound_and_sign():
    metrics = clip_fraction_metrics(RATIO, ADV, MASK, 0.8, 1.2)
    assert metrics["clip/low_neg"].item() == pytest.approx(2 / 4)  # 0.5 and 0.8 (inclusive)
    assert metrics["clip/high_neg"].item() == pytest.approx(1 / 4)  # 1.5
    assert metrics["clip/high_pos"].item() == pytest.approx(1 / 3)  # 1.2 (the masked 2.0 is ignored)
    assert metrics["clip/low_pos"].item() == pytest.approx(1 / 3)  # 0.5
    assert metrics["clip/frac"].item() == pytest.approx(3 / 7)


def test_contributions_hand_computed():
    contrib_pos, contrib_neg = sign_contributions(RATIO, ADV, MASK, 0.8, 1.2)
    assert contrib_pos.item() == pytest.approx(1 * 0.5 + 2 * 1.0)  # 1.2 is clipped, 2.0 masked
    assert contrib_neg.item() == pytest.approx(1 * 1.0 + 1 * 1.5)  # 0.5 and 0.8 clipped
    metrics = contribution_metrics(RATIO, ADV, MASK, 0.8, 1.2)
    assert metrics["clip/p"].item() == pytest.approx(2.5 / 2.5)
    assert metrics["clip/contrib_pos"].item() == pytest.approx(2.5 / 7)


def test_overclip_metrics():
    ratio_ref = torch.tensor([[0.9, 0.7, 1.0, 1.5, 0.5, 1.0, 1.25, 2.0]])
    metrics = overclip_metrics(ratio_ref, RATIO, ADV, MASK, 0.8, 1.2, 0.8, 1.2)
    assert metrics["clip/overclip_neg"].item() == pytest.approx(1 / 4)  # token 0: FP8 0.5 clipped, BF16 0.9 not
    assert metrics["clip/underclip_neg"].item() == pytest.approx(0.0)  # token 1 is clipped in both
    assert metrics["clip/ref_low_neg"].item() == pytest.approx(1 / 4)
    assert metrics["clip/overclip_pos"].item() == 0.0 and metrics["clip/underclip_pos"].item() == 0.0
    assert metrics["clip/ref_contrib_neg"].item() == pytest.approx((0.9 + 1.0 + 1.5) / 7)
    assert metrics["clip/ref_p"].item() == pytest.approx(2.5 / 3.4)
    expected_diff = (abs(math.log(0.5 / 0.9)) + abs(math.log(0.8 / 0.7)) + abs(math.log(1.2 / 1.25))) / 7
    assert metrics["fp8/log_ratio_abs_diff"].item() == pytest.approx(expected_diff, rel=1e-5)


def test_ratio_quantiles_match_torch_quantile():
    generator = torch.Generator().manual_seed(0)
    ratio = torch.exp(torch.randn(7, 13, generator=generator) * 0.2)
    mask = torch.rand(7, 13, generator=generator) < 0.6
    metrics = ratio_quantile_metrics(ratio, mask)
    expected = torch.quantile(ratio[mask], torch.tensor([0.01, 0.05, 0.5, 0.95, 0.99]))
    got = torch.stack([metrics[f"actor/ratio_q{q}"] for q in ("01", "05", "50", "95", "99")])
    torch.testing.assert_close(got, expected)
    assert metrics["actor/ratio_mean"].item() == pytest.approx(ratio[mask].mean().item(), rel=1e-6)
    empty = ratio_quantile_metrics(ratio, torch.zeros_like(mask))
    assert all(v.item() == 1.0 for k, v in empty.items() if "_q" in k)


def test_entropy_from_logits():
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(1))
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits), expected)
    assert entropy_from_logits(torch.zeros(1, 1, 8)).item() == pytest.approx(math.log(8))
    metrics = entropy_metrics(expected, torch.tensor([[1, 0, 0], [0, 0, 1]]))
    assert metrics["actor/entropy"].item() == pytest.approx((expected[0, 0] + expected[1, 2]).item() / 2)


def test_rollout_mismatch_hand_computed():
    train = torch.tensor([[-1.0, -1.0 + math.log(2.0), 5.0]])
    rollout = torch.tensor([[-1.0, -1.0, -5.0]])
    metrics = rollout_mismatch_metrics(train, rollout, torch.tensor([[1, 1, 0]]))
    assert metrics["rollout/abs_logp_diff"].item() == pytest.approx(math.log(2) / 2)
    assert metrics["rollout/max_abs_logp_diff"].item() == pytest.approx(math.log(2))
    assert metrics["rollout/token_mult_prob_error"].item() == pytest.approx((1 + 2) / 2)
    assert metrics["rollout/k3_kl"].item() == pytest.approx((0 + (2 - 1 - math.log(2))) / 2)


def test_everything_is_finite_when_all_masked():
    mask = torch.zeros(2, 3)
    ratio, adv = torch.full((2, 3), float("inf")), torch.ones(2)
    metrics = {
        **clip_fraction_metrics(ratio, adv, mask, 0.8, 1.2),
        **contribution_metrics(ratio, adv, mask, 0.8, 1.2),
        **overclip_metrics(ratio, ratio, adv, mask, 0.8, 1.2, 0.8, 1.2),
        **ratio_quantile_metrics(ratio, mask),
        **rollout_mismatch_metrics(torch.zeros(2, 3), torch.full((2, 3), -1e4), mask),
    }
    assert all(torch.isfinite(v) for v in metrics.values())
