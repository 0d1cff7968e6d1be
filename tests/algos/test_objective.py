"""fp8rl.algos.objective: the run's objective built once and called with tensors only."""

import pytest
import torch

from fp8rl.algos import (
    CorrectionParams,
    Objective,
    TokenBatch,
    aggregate_loss,
    apply_rollout_correction,
    get_policy_loss,
    kl_loss,
    rollout_mismatch_metrics,
)


def _batch(seed=0, rows=4, length=6):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, length, generator=gen) * 2
    logp = (old + torch.randn(rows, length, generator=gen) * 0.3).requires_grad_(True)
    rollout = old + torch.randn(rows, length, generator=gen) * 0.2
    reference = old + torch.randn(rows, length, generator=gen) * 0.1
    mask = torch.rand(rows, length, generator=gen) < 0.8
    return (
        logp,
        old,
        rollout,
        reference,
        torch.randn(rows, generator=gen),
        mask,
        torch.rand(rows, length, generator=gen),
    )


def test_the_objective_is_the_loss_plus_kl_minus_entropy_with_one_normaliser():
    logp, old, rollout, reference, adv, mask, entropy = _batch()
    loss_fn = get_policy_loss("dual_clip").configured(agg="token-mean", dual_clip_c=3.0)
    objective = Objective(loss_fn, "tis_token", CorrectionParams(1.5), kl_coef=0.1, entropy_coef=0.01)
    correction = objective.correct(old, rollout, mask)
    denominator = 2.0 * objective.count(correction)  # as if a second rank held as many tokens
    tokens = TokenBatch(old, adv, mask, correction, reference)
    loss, metrics = objective(logp, entropy, tokens, (0.8, 1.2), denominator)

    expected_correction = apply_rollout_correction(old, rollout, mask, "tis_token", tis_cap=1.5)
    torch.testing.assert_close(correction.weights, expected_correction.weights)
    pg, _ = loss_fn(logp, tokens, (0.8, 1.2), denominator)
    kl, _ = kl_loss(logp, reference, mask, kind="low_var_kl", denominator=denominator)
    bonus = aggregate_loss(entropy, mask, "token-mean", denominator=denominator)
    torch.testing.assert_close(loss, pg + 0.1 * kl - 0.01 * bonus)
    assert metrics["actor/loss"] == loss.detach() and "actor/kl_loss" in metrics
    assert metrics["train/tokens"] == mask.sum()
    assert {"rollout/tis_mean", "rollout/k3_kl"} <= set(correction.metrics)  # once per mini-batch, not per call
    assert not any(key.startswith("rollout/") for key in metrics)


def test_a_micro_batch_of_the_tokens_sees_the_mini_batch_correction():
    logp, old, rollout, _, adv, mask, entropy = _batch(1)
    objective = Objective(get_policy_loss("ppo_clip"), ("tis_token", "mis_token"))
    tokens = TokenBatch(old, adv, mask, objective.correct(old, rollout, mask))
    denominator = objective.count(tokens.correction)
    whole, _ = objective(logp, entropy, tokens, (0.8, 1.2), denominator)
    halves = [torch.arange(0, 2), torch.arange(2, 4)]
    parts = [objective(logp[i], entropy[i], tokens.select(i), (0.8, 1.2), denominator)[0] for i in halves]
    torch.testing.assert_close(sum(parts), whole)
    assert torch.equal(tokens.select(halves[1]).loss_mask, tokens.loss_mask[2:])


def test_mismatch_metrics_are_over_the_mask_before_rejection_and_absent_without_rollout_logp():
    _, old, rollout, _, _, mask, _ = _batch(2)
    objective = Objective(get_policy_loss("ppo_clip"), "mis_token", CorrectionParams(mis_low=0.9, mis_high=1.1))
    correction = objective.correct(old, rollout, mask)
    expected = rollout_mismatch_metrics(old, rollout, mask)
    assert all(torch.equal(correction.metrics[k], v) for k, v in expected.items())
    assert correction.response_mask.sum() < mask.sum()
    assert objective.correct(old, None, mask).metrics == {}


def test_a_kl_penalty_needs_a_reference_and_a_known_estimator():
    logp, old, _, _, adv, mask, entropy = _batch(3)
    objective = Objective(get_policy_loss("ppo_clip"), kl_coef=0.1)
    with pytest.raises(ValueError, match="reference policy"):
        objective(logp, entropy, TokenBatch(old, adv, mask), (0.8, 1.2))
    with pytest.raises(KeyError, match="low_var_kl"):
        Objective(get_policy_loss("ppo_clip"), kl_coef=0.1, kl_type="k9")
