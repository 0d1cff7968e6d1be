import math
import statistics

import pytest
import torch

from fp8rl.algos import broadcast_to_tokens, compute_advantages, grpo_advantages, rloo_advantages


def test_grpo_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 5.0])
    adv = grpo_advantages(rewards, group_size=4)
    std = math.sqrt(4 * 0.25 / 3)  # unbiased std of (1, 0, 0, 1)
    first = 0.5 / (std + 1e-6)
    torch.testing.assert_close(adv[:4], torch.tensor([first, -first, -first, first]))
    # second group: mean 2.75, unbiased std sqrt(3 * 0.75^2 + 2.25^2) / sqrt(3) = 1.5
    torch.testing.assert_close(adv[4:], torch.tensor([-0.75, -0.75, -0.75, 2.25]) / (1.5 + 1e-6))


def test_dr_grpo_only_centres():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv = grpo_advantages(rewards, group_size=4, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_rloo_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv = rloo_advantages(rewards, group_size=4)
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))


def test_uniform_groups_and_singletons_give_zero_not_nan():
    rewards = torch.tensor([1.0, 1.0, 1.0, 3.0])
    ids = torch.tensor([0, 0, 0, 7])  # group 7 has a single response
    for name in ("grpo", "rloo"):
        adv = compute_advantages(name, rewards, group_ids=ids)
        assert torch.equal(adv, torch.zeros(4))


def _grpo_loop(rewards, ids, norm_by_std):
    adv = []
    for i, reward in enumerate(rewards):
        group = [r for r, g in zip(rewards, ids, strict=True) if g == ids[i]]
        if len(group) == 1:
            adv.append(0.0)
            continue
        centred = reward - statistics.fmean(group)
        adv.append(centred / (statistics.stdev(group) + 1e-6) if norm_by_std else centred)
    return adv


def _rloo_loop(rewards, ids):
    adv = []
    for i, reward in enumerate(rewards):
        others = [r for j, (r, g) in enumerate(zip(rewards, ids, strict=True)) if g == ids[i] and j != i]
        adv.append(reward - statistics.fmean(others) if others else 0.0)
    return adv


@pytest.mark.parametrize("seed", range(5))
def test_vectorized_matches_loop_with_shuffled_group_ids(seed):
    generator = torch.Generator().manual_seed(seed)
    group_size, n_groups = 5, 7
    rewards = torch.randint(0, 3, (group_size * n_groups,), generator=generator).to(torch.float64)
    ids = torch.arange(n_groups).repeat_interleave(group_size) * 13  # arbitrary labels
    perm = torch.randperm(len(ids), generator=generator)
    rewards, ids = rewards[perm], ids[perm]
    r, g = rewards.tolist(), ids.tolist()
    for norm_by_std in (True, False):
        expected = torch.tensor(_grpo_loop(r, g, norm_by_std), dtype=torch.float64)
        torch.testing.assert_close(grpo_advantages(rewards, group_ids=ids, norm_by_std=norm_by_std), expected)
    torch.testing.assert_close(rloo_advantages(rewards, group_ids=ids), torch.tensor(_rloo_loop(r, g)).double())


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_group_size_equals_contiguous_group_ids(name):
    rewards = torch.randn(24, generator=torch.Generator().manual_seed(0))
    by_size = compute_advantages(name, rewards, group_size=6)
    by_ids = compute_advantages(name, rewards, group_ids=torch.arange(24) // 6)
    torch.testing.assert_close(by_size, by_ids)
    assert by_size.dtype == rewards.dtype


def test_argument_errors():
    rewards = torch.zeros(6)
    with pytest.raises(ValueError, match="divisible"):
        grpo_advantages(rewards, group_size=4)
    with pytest.raises(ValueError, match="exactly one"):
        grpo_advantages(rewards)
    with pytest.raises(ValueError, match="exactly one"):
        grpo_advantages(rewards, group_size=3, group_ids=torch.zeros(6))
    with pytest.raises(ValueError, match=r"\(batch,\)"):
        grpo_advantages(torch.zeros(2, 3), group_size=3)


def test_broadcast_to_tokens():
    adv = torch.tensor([1.5, -2.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert torch.equal(broadcast_to_tokens(adv, mask), torch.tensor([[1.5, 1.5, 0.0], [-2.0, 0.0, 0.0]]))
