import math

import pytest
import torch

from fp8rl.algos import CorrectionParams, apply_rollout_correction


def _log(values):
    return torch.log(torch.tensor(values, dtype=torch.float64))


def test_token_tis_hand_computed():
    old = torch.zeros(1, 4, dtype=torch.float64)
    rollout = -_log([[0.5, 1.0, 3.0, 100.0]])  # rho = exp(old - rollout) = [0.5, 1, 3, 100]
    mask = torch.tensor([[1, 1, 1, 0]])
    result = apply_rollout_correction(old, rollout, mask, "tis_token", tis_cap=2.0)
    torch.testing.assert_close(result.weights[0, :3], torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64))
    assert result.metrics["rollout/tis_mean"].item() == pytest.approx(3.5 / 3)
    assert result.metrics["rollout/tis_max"].item() == 2.0
    assert result.metrics["rollout/tis_trunc_frac"].item() == pytest.approx(1 / 3)  # the masked 100 is not counted
    assert torch.equal(result.response_mask, mask.bool())


def test_sequence_tis_uses_the_product_over_masked_tokens():
    old = torch.zeros(2, 3, dtype=torch.float64)
    rollout = -_log([[1.5, 2.0, 50.0], [1.0, 0.5, 1.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])  # seq 0: rho = 1.5 (2 and 50 masked), seq 1: 0.5
    result = apply_rollout_correction(old, rollout, mask, "tis_seq")
    expected = torch.tensor([[1.5] * 3, [0.5] * 3], dtype=torch.float64)
    torch.testing.assert_close(result.weights, expected)
    capped = apply_rollout_correction(old, -_log([[3.0, 1.0, 1.0], [1.0, 1.0, 1.0]]), mask, "tis_seq", tis_cap=2.0)
    assert capped.weights[0, 0].item() == pytest.approx(2.0)
    assert capped.metrics["rollout/tis_trunc_frac"].item() == pytest.approx(0.5)


@pytest.mark.parametrize("seed", range(3))
def test_tis_matches_loop_reference(seed):
    generator = torch.Generator().manual_seed(seed)
    old = torch.randn(5, 8, generator=generator, dtype=torch.float64) * 0.5
    rollout = torch.randn(5, 8, generator=generator, dtype=torch.float64) * 0.5
    mask = torch.rand(5, 8, generator=generator) < 0.7
    token = apply_rollout_correction(old, rollout, mask, "tis_token", tis_cap=1.7).weights
    seq = apply_rollout_correction(old, rollout, mask, "tis_seq", tis_cap=1.7).weights
    for i in range(5):
        log_sum = 0.0
        for t in range(8):
            if mask[i, t]:
                rho = math.exp(old[i, t].item() - rollout[i, t].item())
                assert token[i, t].item() == pytest.approx(min(rho, 1.7), rel=1e-12)
                log_sum += old[i, t].item() - rollout[i, t].item()
        assert seq[i, 0].item() == pytest.approx(min(math.exp(log_sum), 1.7), rel=1e-12)


def test_token_mis_and_icepop():
    old = torch.zeros(1, 5, dtype=torch.float64)
    rollout = -_log([[0.4, 0.6, 1.0, 1.9, 2.1]])
    mask = torch.ones(1, 5, dtype=torch.bool)
    mis = apply_rollout_correction(old, rollout, mask, "mis_token")  # default [0.5, 2.0]
    assert mis.weights is None
    assert mis.response_mask.tolist() == [[False, True, True, True, False]]
    assert mis.metrics["rollout/mis_masked_frac"].item() == pytest.approx(0.4)
    ice = apply_rollout_correction(old, rollout, mask, "icepop")
    assert ice.response_mask.tolist() == mis.response_mask.tolist()
    torch.testing.assert_close(ice.weights, torch.tensor([[0.0, 0.6, 1.0, 1.9, 0.0]], dtype=torch.float64))


def test_mis_bounds_are_inclusive():
    old = rollout = torch.zeros(1, 1)  # rho = 1 exactly
    assert apply_rollout_correction(old, rollout, torch.ones(1, 1), "mis_token", mis_low=1.0).response_mask.all()
    assert apply_rollout_correction(
        old, rollout, torch.ones(1, 1), "mis_token", mis_low=0.5, mis_high=1.0
    ).response_mask.all()


def test_sequence_mis_drops_whole_sequences():
    old = torch.zeros(2, 2, dtype=torch.float64)
    rollout = -_log([[1.5, 1.5], [1.2, 0.9]])  # products 2.25 (out) and 1.08 (in)
    result = apply_rollout_correction(old, rollout, torch.ones(2, 2), "mis_seq")
    assert result.response_mask.tolist() == [[False, False], [True, True]]
    assert result.metrics["rollout/mis_seq_masked_frac"].item() == pytest.approx(0.5)


def test_corrections_compose():
    old = torch.zeros(1, 3, dtype=torch.float64)
    rollout = -_log([[0.3, 1.5, 3.0]])
    result = apply_rollout_correction(old, rollout, torch.ones(1, 3), ("tis_token", "mis_token"), mis_high=2.5)
    assert result.response_mask.tolist() == [[False, True, False]]
    assert result.weights[0, 1].item() == pytest.approx(1.5)


def test_no_rollout_logp_means_no_correction():
    result = apply_rollout_correction(torch.zeros(2, 2), None, torch.ones(2, 2), "tis_seq", tis_cap=1.5)
    assert result.weights is None and result.metrics == {} and result.response_mask.all()


def test_all_masked_gives_finite_metrics():
    old, rollout = torch.zeros(2, 3), torch.full((2, 3), -50.0)
    for name in ("tis_token", "tis_seq", "mis_token", "mis_seq", "icepop"):
        result = apply_rollout_correction(old, rollout, torch.zeros(2, 3), name)
        assert all(torch.isfinite(v) for v in result.metrics.values()), name


def test_parameter_validation_and_unknown_name():
    with pytest.raises(ValueError):
        CorrectionParams(tis_cap=0.0)
    with pytest.raises(ValueError):
        CorrectionParams(mis_low=2.0, mis_high=1.0)
    with pytest.raises(KeyError, match="icepop, mis_seq, mis_token, none, tis_seq, tis_token"):
        apply_rollout_correction(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "tis")
