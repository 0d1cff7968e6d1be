"""DAPO's data-side pieces (Yu et al. 2025): dynamic sampling and overlong reward shaping.

DAPO's loss side is a preset, not a fork: clip-higher (``clip_low = 1 - 0.2``, ``clip_high = 1 + 0.28``)
with ``agg="token-mean"`` (``aggregation.py``) and no KL term.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fp8rl.algos.advantages import group_index


class GroupFilter(NamedTuple):
    """Result of :func:`filter_uniform_groups`."""

    keep: torch.Tensor  # (batch,) bool: sequences whose group has reward variation
    num_dropped_groups: int


def filter_uniform_groups(
    rewards: torch.Tensor,
    group_size: int | None = None,
    *,
    group_ids: torch.Tensor | None = None,
    atol: float = 0.0,
) -> GroupFilter:
    """Dynamic sampling (DAPO eq. 11): drop groups whose rewards are all equal (all correct or all wrong),
    since their GRPO advantages are all zero.

    Args:
        rewards: (batch,) per-sequence rewards.
        group_size: contiguous groups of this size; or ``group_ids`` (batch,) labels.
        atol: rewards within ``atol`` of each other count as equal (max - min <= atol).
    Returns:
        ``GroupFilter(keep (batch,) bool, num_dropped_groups)``.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be (batch,), got {tuple(rewards.shape)}")
    index, n_groups = group_index(rewards.shape[0], group_size=group_size, group_ids=group_ids, device=rewards.device)
    values = rewards.to(torch.float64)
    group_max = values.new_full((n_groups,), -torch.inf).scatter_reduce(0, index, values, "amax")
    group_min = values.new_full((n_groups,), torch.inf).scatter_reduce(0, index, values, "amin")
    uniform = (group_max - group_min) <= atol
    return GroupFilter(~uniform[index], int(uniform.sum()))


def overlong_penalty(
    response_len: torch.Tensor | int, max_len: int, buffer_len: int, factor: float = 1.0
) -> torch.Tensor:
    """Soft overlong punishment (DAPO eq. 13), added to the task reward.

    penalty = min(-(len - (max_len - buffer_len)) / buffer_len * factor, 0), i.e. 0 up to
    max_len - buffer_len, then linear down to -factor at max_len; clamped at -factor beyond max_len
    (DAPO's -1 for truncated responses, times ``factor``).

    Args:
        response_len: (batch,) response lengths in tokens (or an int).
    Returns:
        (batch,) float32 penalties, <= 0.
    """
    if buffer_len <= 0 or buffer_len > max_len:
        raise ValueError(f"need 0 < buffer_len <= max_len, got buffer_len={buffer_len}, max_len={max_len}")
    length = torch.as_tensor(response_len, dtype=torch.float32)
    penalty = -(length - (max_len - buffer_len)) / buffer_len * factor  # DAPO eq. 13
    return penalty.clamp(min=-abs(factor), max=0.0)
