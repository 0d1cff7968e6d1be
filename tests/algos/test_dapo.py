import pytest
import torch

from fp8rl.algos import filter_uniform_groups, overlong_penalty


def test_filter_uniform_groups_contiguous():
    rewards = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 1, 0, 0, 0, 0])
    keep, dropped = filter_uniform_groups(rewards, 4)
    assert keep.tolist() == [False] * 4 + [True] * 4 + [False] * 4
    assert dropped == 2


def test_filter_uniform_groups_by_ids_and_tolerance():
    rewards = torch.tensor([0.5, 1.0, 0.5, 0.5001])
    ids = torch.tensor([3, 9, 9, 3])
    keep, dropped = filter_uniform_groups(rewards, group_ids=ids)
    assert keep.tolist() == [True, True, True, True] and dropped == 0
    keep, dropped = filter_uniform_groups(rewards, group_ids=ids, atol=1e-3)
    assert keep.tolist() == [False, True, True, False] and dropped == 1


def test_filter_requires_groups():
    with pytest.raises(ValueError):
        filter_uniform_groups(torch.zeros(6), 4)


@pytest.mark.parametrize(
    ("length", "expected"),
    [(0, 0.0), (50, 0.0), (80, 0.0), (90, -0.5), (95, -0.75), (100, -1.0), (130, -1.0)],
)
def test_overlong_penalty_hand_computed(length, expected):
    # L_max = 100, L_buf = 20: free up to 80, then linear to -1 at 100 (DAPO eq. 13), -1 beyond
    assert overlong_penalty(length, max_len=100, buffer_len=20).item() == pytest.approx(expected)


def test_overlong_penalty_vector_and_factor():
    penalty = overlong_penalty(torch.tensor([70, 90, 100]), max_len=100, buffer_len=20, factor=0.5)
    torch.testing.assert_close(penalty, torch.tensor([0.0, -0.25, -0.5]))


def test_overlong_penalty_rejects_bad_buffer():
    with pytest.raises(ValueError):
        overlong_penalty(10, max_len=100, buffer_len=0)
