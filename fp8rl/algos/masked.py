"""Masked tensor helpers shared by the losses, calibration and diagnostics.

Conventions used across ``fp8rl.algos``:

- ``response_mask`` is (batch, response_len); any dtype, nonzero = the token counts. It is turned into a
  bool tensor once by :func:`as_bool_mask`.
- Statistics over an empty selection are defined (0 for sums, means and fractions; a documented fill value
  for quantiles) and never NaN, because an all-masked micro-batch is a normal event (dynamic sampling, MIS).
- Metrics are 0-d detached tensors (no host sync per metric); :func:`metrics_to_floats` converts a whole
  metrics dict with one transfer per device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

Metrics = dict[str, torch.Tensor]


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """(batch, response_len) mask of any dtype -> bool mask (nonzero = counted)."""
    return mask if mask.dtype == torch.bool else mask != 0


def at_least_float32(values: torch.Tensor) -> torch.Tensor:
    """Upcast 16-bit floats to float32 (ratios and their exp need the range); float32/64 pass through."""
    return values.float() if values.dtype in (torch.float16, torch.bfloat16) else values


def check_token_shapes(*tensors: torch.Tensor | None, names: Sequence[str]) -> None:
    """Raise ``ValueError`` unless all given (non-None) tensors are 2-D with one shared shape."""
    shapes = {name: tuple(t.shape) for name, t in zip(names, tensors, strict=True) if t is not None}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(shape != first for shape in shapes.values()):
        described = ", ".join(f"{name}={shape}" for name, shape in shapes.items())
        raise ValueError(f"expected (batch, response_len) tensors of one shape, got {described}")


def expand_adv(adv: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-sequence (batch,) or per-token (batch, response_len) advantages -> (batch, response_len) view."""
    if adv.dim() == 1 and adv.shape[0] == like.shape[0]:
        return adv.unsqueeze(-1).expand_as(like)
    if adv.shape == like.shape:
        return adv
    raise ValueError(f"adv must be (batch,) or (batch, response_len) = {tuple(like.shape)}, got {tuple(adv.shape)}")


def safe_div(numerator: torch.Tensor, denominator: torch.Tensor | float) -> torch.Tensor:
    """numerator / denominator, and 0 where the denominator is 0 (keeps the numerator's graph)."""
    denominator = torch.as_tensor(denominator, dtype=numerator.dtype, device=numerator.device)
    return torch.where(denominator != 0, numerator / torch.where(denominator != 0, denominator, 1), 0)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` (bool) is set; masked-out entries may hold NaN/inf safely."""
    selected = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return selected.sum() if dim is None else selected.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over ``mask`` (bool); 0 over an empty selection."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return safe_div(masked_sum(values, mask, dim), count.to(values.dtype))


def masked_fraction(condition: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Fraction of the ``mask`` entries where ``condition`` holds (float32, 0-d); 0 if ``mask`` is empty."""
    return safe_div((condition & mask).sum().float(), mask.sum().float())


def masked_quantiles(
    values: torch.Tensor, mask: torch.Tensor, qs: Sequence[float], empty_value: float = 1.0
) -> torch.Tensor:
    """Quantiles (linear interpolation, as ``torch.quantile``) of ``values[mask]``.

    Args:
        values: any shape; mask: bool, same shape; qs: quantile levels in [0, 1].
        empty_value: returned for every level when the mask is empty (1.0 = "ratio unchanged").
    Returns:
        (len(qs),) tensor in ``values``' dtype, detached.

    On CPU a multi-select (``numpy.partition``, O(n)) replaces the full sort, about 6x faster on 1M values;
    elsewhere a sort keeps the computation on the device without a host sync.
    """
    values = values.detach()
    if values.device.type == "cpu":
        return _quantiles_by_partition(values, mask, qs, empty_value)
    return _quantiles_by_sort(values, mask, qs, empty_value)


def _quantiles_by_sort(values: torch.Tensor, mask: torch.Tensor, qs: Sequence[float], empty_value: float):
    flat = torch.where(mask, values, torch.full((), float("inf"), dtype=values.dtype, device=values.device))
    ordered = flat.flatten().sort().values  # masked-out entries sort last
    count = mask.sum()
    levels = torch.tensor(list(qs), dtype=torch.float64, device=values.device)
    position = levels * (count - 1).clamp(min=0).to(torch.float64)
    below, above = position.floor().long(), position.ceil().long()
    weight = (position - below).to(values.dtype)
    lower, upper = ordered[below], ordered[above]
    result = lower + weight * torch.where(above == below, torch.zeros_like(upper), upper - lower)
    return torch.where(count > 0, result, torch.full_like(result, empty_value))


def _quantiles_by_partition(values: torch.Tensor, mask: torch.Tensor, qs: Sequence[float], empty_value: float):
    selected = at_least_float32(values[mask]).numpy()
    if selected.size == 0:
        return torch.full((len(qs),), empty_value, dtype=values.dtype)
    position = np.asarray(qs, dtype=np.float64) * (selected.size - 1)
    below, above = np.floor(position).astype(np.int64), np.ceil(position).astype(np.int64)
    partitioned = np.partition(selected, np.unique(np.concatenate([below, above])))
    lower, upper = partitioned[below].astype(np.float64), partitioned[above].astype(np.float64)
    result = lower + (position - below) * np.where(above == below, 0.0, upper - lower)
    return torch.from_numpy(result).to(values.dtype)


def metrics_to_floats(metrics: Mapping[str, torch.Tensor | float | int]) -> dict[str, float]:
    """Convert a metrics dict (0-d tensors or numbers) to python floats, one device transfer per device."""
    result: dict[str, float] = {}
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            by_device.setdefault(value.device, []).append((key, value))
        else:
            result[key] = float(value)
    for entries in by_device.values():
        stacked = torch.stack([value.detach().reshape(()).to(torch.float64) for _, value in entries]).tolist()
        result.update({key: float(number) for (key, _), number in zip(entries, stacked, strict=True)})
    return {key: result[key] for key in metrics}
