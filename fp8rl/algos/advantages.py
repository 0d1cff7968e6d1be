"""Outcome advantage estimators over groups of responses to the same prompt.

Every estimator maps per-sequence rewards (batch,) to per-sequence advantages (batch,); groups are given
either by ``group_size`` (contiguous groups of G responses, the rollout layout) or by ``group_ids``
(batch,) of any integer labels. :func:`broadcast_to_tokens` spreads them over the response tokens.

Registered estimators (``get_advantage_estimator(name)``):

- ``"grpo"``: (R_i - mean_g R) / (std_g R + 1e-6) (GRPO, Shao et al. 2024, eq. 3). ``std`` is the
  unbiased (Bessel-corrected) sample std, as ``torch.std`` in verl; ``unbiased=False`` divides by G.
  ``norm_by_std=False`` gives Dr.GRPO (Liu et al. 2025): R_i - mean_g R.
- ``"rloo"``: R_i - mean_{j != i} R_j (Ahmadian et al. 2024), i.e. G / (G - 1) * (R_i - mean_g R).

Project choice: a group with a single response has no within-group baseline, so its advantage is 0 for
every estimator (verl instead uses mean 0 and std 1 for GRPO, i.e. A = R).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fp8rl.algos.registry import Registry

GRPO_EPS = 1e-6  # GRPO denominator epsilon: A = (R - mean) / (std + GRPO_EPS)

AdvantageEstimator = Callable[..., torch.Tensor]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator ``(rewards, *, group_size=None, group_ids=None, **kwargs) -> adv (batch,)``."""
    return ADVANTAGE_ESTIMATORS.get(name)


def compute_advantages(
    name: str,
    rewards: torch.Tensor,
    *,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """Per-sequence advantages (batch,) from rewards (batch,) with the named estimator."""
    return get_advantage_estimator(name)(rewards, group_size=group_size, group_ids=group_ids, **kwargs)


def group_index(
    batch: int, *, group_size: int | None = None, group_ids: torch.Tensor | None = None, device=None
) -> tuple[torch.Tensor, int]:
    """Dense group index (batch,) in [0, n_groups) and n_groups, from ``group_size`` xor ``group_ids``."""
    if (group_size is None) == (group_ids is None):
        raise ValueError("give exactly one of group_size (contiguous groups) or group_ids (batch,)")
    if group_ids is not None:
        if group_ids.shape != (batch,):
            raise ValueError(f"group_ids must have shape ({batch},), got {tuple(group_ids.shape)}")
        unique_ids, index = torch.unique(group_ids, return_inverse=True)
        return index, int(unique_ids.numel())
    if group_size <= 0 or batch % group_size != 0:
        raise ValueError(f"batch size {batch} is not divisible by group_size {group_size}")
    return torch.arange(batch, device=device) // group_size, batch // group_size


def group_stats(
    rewards: torch.Tensor, index: torch.Tensor, n_groups: int, *, unbiased: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence group count, mean and std, each (batch,), computed in float64 by scatter-add."""
    values = rewards.to(torch.float64)
    zeros = torch.zeros(n_groups, dtype=torch.float64, device=rewards.device)
    count = zeros.index_add(0, index, torch.ones_like(values))
    mean = zeros.index_add(0, index, values) / count
    squared_dev = (values - mean[index]) ** 2
    dof = (count - 1).clamp(min=1) if unbiased else count
    std = (zeros.index_add(0, index, squared_dev) / dof).sqrt()
    return count[index], mean[index], std[index]


def _rewards_1d(rewards: torch.Tensor) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be (batch,), got {tuple(rewards.shape)}")
    return rewards


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(
    rewards: torch.Tensor,
    *,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    norm_by_std: bool = True,
    unbiased: bool = True,
    eps: float = GRPO_EPS,
) -> torch.Tensor:
    """GRPO (or Dr.GRPO with ``norm_by_std=False``) advantages (batch,) from rewards (batch,)."""
    rewards = _rewards_1d(rewards)
    index, n_groups = group_index(rewards.shape[0], group_size=group_size, group_ids=group_ids, device=rewards.device)
    count, mean, std = group_stats(rewards, index, n_groups, unbiased=unbiased)
    centered = rewards.to(torch.float64) - mean
    adv = centered / (std + eps) if norm_by_std else centered  # GRPO eq. 3; Dr.GRPO drops the std
    return torch.where(count > 1, adv, 0).to(rewards.dtype)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(
    rewards: torch.Tensor, *, group_size: int | None = None, group_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """RLOO advantages (batch,): each reward minus the mean of the other rewards of its group."""
    rewards = _rewards_1d(rewards)
    index, n_groups = group_index(rewards.shape[0], group_size=group_size, group_ids=group_ids, device=rewards.device)
    count, mean, _ = group_stats(rewards, index, n_groups)
    adv = count / (count - 1).clamp(min=1) * (rewards.to(torch.float64) - mean)  # R_i - mean_{j != i} R_j
    return torch.where(count > 1, adv, 0).to(rewards.dtype)


def broadcast_to_tokens(adv: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence advantages (batch,) -> per-token (batch, response_len), zero on masked-out tokens."""
    mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    return torch.where(mask, adv.unsqueeze(-1), torch.zeros((), dtype=adv.dtype, device=adv.device))
