import pytest
import torch

from fp8rl.algos import AGGREGATION_MODES, aggregate_loss

LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 21 / 5),  # (1 + 2 + 5 + 6 + 7) / 5
        ("seq-mean-token-mean", (1.5 + 6.0) / 2),  # the empty third row is left out
        ("seq-mean-token-sum", (3 + 18) / 2),
        ("seq-mean-token-sum-norm", 21 / (3 * 4)),  # constant: batch * response_len
    ],
)
def test_hand_computed(mode, expected):
    assert aggregate_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_norm_constant_override():
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_constant=10).item() == pytest.approx(21 / 30)
    with pytest.raises(ValueError, match="positive"):
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_constant=0)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_masked_entries_are_never_read(mode):
    poisoned = LOSS.clone().requires_grad_(True)
    with torch.no_grad():
        poisoned[MASK == 0] = float("nan")
    loss = aggregate_loss(poisoned, MASK, mode)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(poisoned.grad).all()
    assert torch.all(poisoned.grad[MASK == 0] == 0)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_all_masked_is_zero_with_grad(mode):
    loss_in = torch.randn(2, 3, requires_grad=True)
    loss = aggregate_loss(loss_in, torch.zeros(2, 3), mode)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(loss_in.grad, torch.zeros(2, 3))


def test_token_mean_gradient_is_uniform_over_masked_tokens():
    loss_in = torch.randn(3, 4, requires_grad=True)
    aggregate_loss(loss_in, MASK, "token-mean").backward()
    assert torch.equal(loss_in.grad, MASK.float() / 5)


def _loop(loss, mask, mode):
    rows = [[v for v, m in zip(lr, mr, strict=True) if m] for lr, mr in zip(loss.tolist(), mask.tolist(), strict=True)]
    tokens = [v for row in rows for v in row]
    nonempty = [row for row in rows if row]
    if mode == "token-mean":
        return sum(tokens) / len(tokens) if tokens else 0.0
    if mode == "seq-mean-token-mean":
        return sum(sum(row) / len(row) for row in nonempty) / len(nonempty) if nonempty else 0.0
    if mode == "seq-mean-token-sum":
        return sum(sum(row) for row in nonempty) / len(nonempty) if nonempty else 0.0
    return sum(tokens) / (loss.shape[0] * loss.shape[1])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_matches_loop_reference(seed, mode):
    generator = torch.Generator().manual_seed(seed)
    loss = torch.randn(6, 9, generator=generator, dtype=torch.float64)
    mask = torch.rand(6, 9, generator=generator) < 0.5
    mask[seed % 6] = False  # always one empty sequence
    assert aggregate_loss(loss, mask, mode).item() == pytest.approx(_loop(loss, mask, mode), rel=1e-12)


def test_unknown_mode_lists_valid_modes():
    with pytest.raises(ValueError, match="seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm"):
        aggregate_loss(LOSS, MASK, "seq-sum")


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="response_len"):
        aggregate_loss(LOSS, MASK[:, :3])
