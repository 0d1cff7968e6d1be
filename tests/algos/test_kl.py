import math

import pytest
import torch

from fp8rl.algos import get_kl_estimator, kl_loss, kl_penalty


def test_hand_computed_values():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([[0.5, -1.0]]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([[0.125, 0.5]]))
    expected_k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), torch.tensor([expected_k3]))


def test_aliases_are_the_same_estimators():
    assert get_kl_estimator("kl") is get_kl_estimator("k1")
    assert get_kl_estimator("mse") is get_kl_estimator("k2")
    assert get_kl_estimator("low_var_kl") is get_kl_estimator("k3")


def test_k3_is_nonnegative_and_clamped():
    logp = torch.tensor([[0.0, 0.0, -50.0]])
    ref = torch.tensor([[0.0, -50.0, 0.0]])
    values = kl_penalty(logp, ref, "k3")
    assert values[0, 0] == 0
    assert torch.all(values >= 0) and torch.all(values <= 10)
    assert values[0, 2] == 10  # exp(50) clamped


def test_kl_loss_aggregates_and_reports():
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -100.0]])
    loss, metrics = kl_loss(logp, ref, torch.tensor([[1, 1, 0]]), kind="k1", agg="token-mean")
    assert loss.item() == pytest.approx((0.5 - 1.0) / 2)
    assert metrics["actor/kl_loss"].item() == pytest.approx(loss.item())
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.5, 0.5, 0.0]]))


def test_unknown_kind_raises():
    with pytest.raises(KeyError, match="k1, k2, k3"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")
