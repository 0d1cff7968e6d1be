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


# ------------------------------------------------------------------------- verl's rollout_corr metrics
def _verl_offpolicy_by_hand(train, rollout, mask) -> dict[str, float]:
    """verl's compute_offpolicy_metrics (verl/trainer/ppo/rollout_corr_helper.py at 0b4e2a8), written out per
    token and per sequence in Python floats: its masked means divide by count + 1e-8, its chi-square metrics
    clamp log ratios at +-20, its k3 does not."""
    import math

    rows = []
    tokens = {"n": 0, "kl": 0.0, "k3": 0.0, "rho2": 0.0}
    for t_row, r_row, m_row in zip(train.tolist(), rollout.tolist(), mask.tolist(), strict=True):
        kept = [(t, r) for t, r, m in zip(t_row, r_row, m_row, strict=True) if m]
        n = len(kept)
        mean_t, mean_r = sum(t for t, _ in kept) / (n + 1e-8), sum(r for _, r in kept) / (n + 1e-8)
        rows.append((mean_t, mean_r, sum(t - r for t, r in kept)))
        for t, r in kept:
            lr = t - r
            tokens["n"] += 1
            tokens["kl"] += r - t
            tokens["k3"] += math.exp(lr) - lr - 1
            tokens["rho2"] += math.exp(max(-20.0, min(20.0, lr))) ** 2
    n_seq = len(rows)
    diffs = [mr - mt for mt, mr, _ in rows]
    return {
        "rollout_corr/kl": tokens["kl"] / tokens["n"],
        "rollout_corr/k3_kl": tokens["k3"] / tokens["n"],
        "rollout_corr/training_ppl": sum(math.exp(-mt) for mt, _, _ in rows) / n_seq,
        "rollout_corr/training_log_ppl": sum(-mt for mt, _, _ in rows) / n_seq,
        "rollout_corr/rollout_ppl": sum(math.exp(-mr) for _, mr, _ in rows) / n_seq,
        "rollout_corr/rollout_log_ppl": sum(-mr for _, mr, _ in rows) / n_seq,
        "rollout_corr/log_ppl_diff": sum(diffs) / n_seq,
        "rollout_corr/log_ppl_abs_diff": sum(abs(d) for d in diffs) / n_seq,
        "rollout_corr/log_ppl_diff_max": max(diffs),
        "rollout_corr/log_ppl_diff_min": min(diffs),
        "rollout_corr/ppl_ratio": sum(math.exp(d) for d in diffs) / n_seq,
        "rollout_corr/chi2_token": tokens["rho2"] / tokens["n"] - 1.0,
        "rollout_corr/chi2_seq": sum(math.exp(2 * max(-20.0, min(20.0, s))) for _, _, s in rows) / n_seq - 1.0,
    }


def _offpolicy_inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(6, 9, generator=gen) * 3
    train = rollout + torch.randn(6, 9, generator=gen) * 0.05
    train[2, 3] = rollout[2, 3] + 25.0  # an outlier token: the clamps act
    mask = torch.rand(6, 9, generator=gen) > 0.3
    mask[:, 0] = True
    return train, rollout, mask


def test_offpolicy_metrics_equal_verls_formulas() -> None:
    from fp8rl.algos import offpolicy_metrics, offpolicy_statistics

    train, rollout, mask = _offpolicy_inputs()
    ours = {k: float(v) for k, v in offpolicy_metrics(offpolicy_statistics(train, rollout, mask)).items()}
    expected = _verl_offpolicy_by_hand(train.double(), rollout.double(), mask)
    assert ours.keys() == expected.keys()
    for key, value in expected.items():
        assert ours[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_offpolicy_metrics_of_two_ranks_shares_equal_the_whole_batchs() -> None:
    """Per-sequence vectors concatenated and token sums added (what the trainer's DP helpers do)."""
    from fp8rl.algos import offpolicy_metrics, offpolicy_statistics

    train, rollout, mask = _offpolicy_inputs(seed=1)
    whole = offpolicy_metrics(offpolicy_statistics(train, rollout, mask))
    halves = [offpolicy_statistics(train[rows], rollout[rows], mask[rows]) for rows in (slice(0, 3), slice(3, 6))]
    combined = {
        k: sum(h[k] for h in halves) if k == "token_sums" else torch.cat([h[k] for h in halves]) for k in halves[0]
    }
    for key, value in offpolicy_metrics(combined).items():
        assert float(value) == pytest.approx(float(whole[key]), rel=1e-12), key


def test_class_overclip_metrics_are_the_lower_bound_pair_within_the_class():
    """FP8's dose on a token class (the junk organism's junk letters): of the A < 0 tokens of the class, the share
    FP8 clips and BF16 does not, and the reverse; and the class's share of the A < 0 tokens."""
    from fp8rl.algos import class_overclip_metrics

    ratio_ref = torch.tensor([[0.9, 0.7, 0.9, 0.9, 0.9, 0.7]])
    ratio = torch.tensor([[0.7, 0.9, 0.7, 0.9, 0.7, 0.7]])
    adv = torch.tensor([[-1.0, -1.0, -1.0, -1.0, 1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    junk = torch.tensor([[True, True, False, True, True, True]])
    m = class_overclip_metrics(ratio_ref, ratio, adv, mask, 0.8, 0.8, junk, "junk")
    # A < 0 junk tokens in the mask: 0 (over-clipped), 1 (under-clipped), 3 (neither); token 4 is A > 0, 5 masked
    assert float(m["clip/overclip_neg_junk"]) == pytest.approx(1 / 3)
    assert float(m["clip/underclip_neg_junk"]) == pytest.approx(1 / 3)
    assert float(m["clip/neg_share_junk"]) == pytest.approx(3 / 4)


def test_overclip_breakdown_counts_both_bounds_per_group():
    """FP8's clipping error counted per group at both bounds: A < 0 at the lower bound, A > 0 at the upper, over
    the masked tokens of the group; counts, so shares pool as ratios of sums."""
    from fp8rl.algos import overclip_breakdown_counts

    ratio_ref = torch.tensor([[0.9, 0.7, 0.9, 1.1, 1.3, 1.1, 0.7]])
    ratio = torch.tensor([[0.7, 0.9, 0.9, 1.3, 1.1, 1.3, 0.7]])
    adv = torch.tensor([[-1.0, -1.0, -1.0, 1.0, 1.0, 1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    group = torch.tensor([[True, True, True, True, True, False, True]])
    m = overclip_breakdown_counts(ratio_ref, ratio, adv, mask, (0.8, 1.2), (0.8, 1.2), {"g": group})
    counts = {k.removeprefix("clip/count/"): float(v) for k, v in m.items()}
    # A < 0 in the mask and the group: tokens 0 (over), 1 (under), 2 (neither); 6 is masked out
    assert (counts["neg_g"], counts["overclip_neg_g"], counts["underclip_neg_g"]) == (3, 1, 1)
    # A > 0: tokens 3 (over at the upper bound), 4 (under); 5 is outside the group
    assert (counts["pos_g"], counts["overclip_pos_g"], counts["underclip_pos_g"]) == (2, 1, 1)


def test_p_old_groups_partition_the_tokens_by_old_probability():
    from fp8rl.algos import p_old_groups

    prob = torch.tensor([[0.0, 0.005, 0.01, 0.05, 0.2, 0.5, 1.0]])
    groups = p_old_groups(torch.log(prob))
    assert list(groups) == ["pold_0_1", "pold_1_10", "pold_10_50", "pold_50_100"]
    members = {name: mask[0].nonzero().flatten().tolist() for name, mask in groups.items()}
    assert members == {"pold_0_1": [0, 1], "pold_1_10": [2, 3], "pold_10_50": [4], "pold_50_100": [5, 6]}
