"""Rollout (train/inference mismatch) corrections: TIS and MIS / IcePop.

The rollout engine samples with pi_rollout (FP8 vLLM) while the trainer's old policy pi_old is an FP8
forward of the same weights; the two differ. With the rollout ratio rho_t = pi_old(y_t) / pi_rollout(y_t)
= exp(old_logp - rollout_logp), a correction returns per-token weights (stop-gradient) that multiply the
per-token policy loss, and/or a smaller response mask.

Registered corrections (``get_rollout_correction(name)``, chosen in a loss by ``rollout_correction=``):

- ``"none"``: nothing (rollout/train mismatch metrics are still reported by the loss).
- ``"tis_token"``: w_t = min(rho_t, C) (TIS, Yao et al. 2025; the paper runs it everywhere with C = 2).
- ``"tis_seq"``: w_i = min(prod_t rho_t, C) = min(exp(sum_t log rho_t), C) over the masked tokens of
  sequence i, applied to all its tokens.
- ``"mis_token"``: tokens whose rho_t leaves [C_lo, C_hi] are removed from the response mask (masked
  importance sampling / rejection, weight 1 for kept tokens).
- ``"mis_seq"``: whole sequences whose product ratio prod_t rho_t leaves [C_lo, C_hi] are removed.
- ``"icepop"``: IcePop (Ling team 2025): mask tokens outside [C_lo, C_hi], weight kept tokens by rho_t.

Several names may be combined (weights multiply, masks intersect), e.g. ``("tis_token", "mis_seq")``.
Defaults (project choices, config-overridable): C = 2, [C_lo, C_hi] = [0.5, 2.0], bounds inclusive.
Removed tokens leave the response mask, so they also leave the denominator of ``token-mean``.
Weight metrics (``rollout/tis_*``) are over masked tokens (sequences with at least one masked token for
the sequence-level variants) *before* MIS masking; a truncated token is one with rho_t > C.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fp8rl.algos.masked import Metrics, as_bool_mask, at_least_float32, masked_fraction, masked_mean, masked_sum
from fp8rl.algos.registry import Registry

DEFAULT_TIS_CAP = 2.0  # the paper's C
DEFAULT_MIS_LOW = 0.5
DEFAULT_MIS_HIGH = 2.0


@dataclass(frozen=True)
class CorrectionParams:
    """Hyper-parameters shared by the corrections: TIS cap C and the MIS interval [mis_low, mis_high]."""

    tis_cap: float = DEFAULT_TIS_CAP
    mis_low: float = DEFAULT_MIS_LOW
    mis_high: float = DEFAULT_MIS_HIGH

    def __post_init__(self) -> None:
        if not self.tis_cap > 0:
            raise ValueError(f"tis_cap must be positive, got {self.tis_cap}")
        if not 0 <= self.mis_low < self.mis_high:
            raise ValueError(f"need 0 <= mis_low < mis_high, got [{self.mis_low}, {self.mis_high}]")


@dataclass(frozen=True)
class RolloutCorrection:
    """Result of a correction.

    Attributes:
        weights: (batch, response_len) detached per-token loss multipliers, or None for "all ones".
        response_mask: (batch, response_len) bool mask after rejection.
        metrics: ``rollout/`` metrics, 0-d detached tensors.
    """

    weights: torch.Tensor | None
    response_mask: torch.Tensor
    metrics: Metrics


CorrectionFn = Callable[[torch.Tensor, torch.Tensor, CorrectionParams], RolloutCorrection]
ROLLOUT_CORRECTIONS: Registry[CorrectionFn] = Registry("rollout correction")


def get_rollout_correction(name: str) -> CorrectionFn:
    """The correction ``(rollout_log_ratio, response_mask, params) -> RolloutCorrection``."""
    return ROLLOUT_CORRECTIONS.get(name)


def apply_rollout_correction(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor | None,
    response_mask: torch.Tensor,
    correction: str | Sequence[str] | None = None,
    *,
    tis_cap: float | None = None,
    mis_low: float = DEFAULT_MIS_LOW,
    mis_high: float = DEFAULT_MIS_HIGH,
) -> RolloutCorrection:
    """Apply the named correction(s) to (batch, response_len) log-probs.

    ``rollout_logp=None`` means no correction. With ``rollout_logp`` given, ``correction=None`` means
    ``"tis_token"`` (the paper's setup) with cap ``tis_cap`` (default 2).
    """
    mask = as_bool_mask(response_mask)
    if rollout_logp is None:
        return RolloutCorrection(None, mask, {})
    names = ["tis_token"] if correction is None else [correction] if isinstance(correction, str) else list(correction)
    params = CorrectionParams(DEFAULT_TIS_CAP if tis_cap is None else tis_cap, mis_low, mis_high)
    log_ratio = torch.where(mask, (at_least_float32(old_logp) - at_least_float32(rollout_logp)).detach(), 0)
    weights, metrics = None, {}
    for name in names:
        step = get_rollout_correction(name)(log_ratio, mask, params)
        if step.weights is not None:
            weights = step.weights if weights is None else weights * step.weights
        metrics.update(step.metrics)
        mask = step.response_mask
    return RolloutCorrection(weights, mask, metrics)


def _capped_exp(log_value: torch.Tensor, cap: float) -> torch.Tensor:
    """min(exp(log_value), cap), computed without overflowing exp."""
    return torch.clamp(torch.exp(log_value.clamp(max=math.log(cap) + 1.0)), max=cap)


def _weight_metrics(weights: torch.Tensor, truncated: torch.Tensor, mask: torch.Tensor) -> Metrics:
    return {
        "rollout/tis_mean": masked_mean(weights, mask),
        "rollout/tis_max": torch.where(mask, weights, 0).max() if weights.numel() else weights.new_zeros(()),
        "rollout/tis_trunc_frac": masked_fraction(truncated, mask),
    }


@ROLLOUT_CORRECTIONS.register("none")
def no_correction(log_ratio: torch.Tensor, mask: torch.Tensor, params: CorrectionParams) -> RolloutCorrection:
    """Identity: no weights, mask unchanged."""
    return RolloutCorrection(None, mask, {})


@ROLLOUT_CORRECTIONS.register("tis_token")
def token_tis(log_ratio: torch.Tensor, mask: torch.Tensor, params: CorrectionParams) -> RolloutCorrection:
    """Token TIS: w_t = min(pi_old / pi_rollout, C), stop-gradient (TIS, Yao et al. 2025)."""
    weights = _capped_exp(log_ratio, params.tis_cap)  # w_t = min(exp(old_logp - rollout_logp), C)
    truncated = log_ratio > math.log(params.tis_cap)
    return RolloutCorrection(weights, mask, _weight_metrics(weights, truncated, mask))


@ROLLOUT_CORRECTIONS.register("tis_seq")
def sequence_tis(log_ratio: torch.Tensor, mask: torch.Tensor, params: CorrectionParams) -> RolloutCorrection:
    """Sequence TIS: w_i = min(prod_t pi_old / pi_rollout, C) over the masked tokens, on every token of i."""
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1)
    seq_weights = _capped_exp(seq_log_ratio, params.tis_cap)  # w_i = min(exp(sum_t log rho_t), C)
    nonempty = mask.any(-1)
    metrics = _weight_metrics(seq_weights, seq_log_ratio > math.log(params.tis_cap), nonempty)
    return RolloutCorrection(seq_weights.unsqueeze(-1).expand_as(log_ratio), mask, metrics)


def _inside(log_ratio: torch.Tensor, params: CorrectionParams) -> torch.Tensor:
    ratio = torch.exp(log_ratio)
    return (ratio >= params.mis_low) & (ratio <= params.mis_high)  # MIS keeps rho in [C_lo, C_hi]


@ROLLOUT_CORRECTIONS.register("mis_token")
def token_mis(log_ratio: torch.Tensor, mask: torch.Tensor, params: CorrectionParams) -> RolloutCorrection:
    """Token MIS: drop tokens whose rollout ratio leaves [mis_low, mis_high]."""
    keep = _inside(log_ratio, params)
    return RolloutCorrection(None, mask & keep, {"rollout/mis_masked_frac": masked_fraction(~keep, mask)})


@ROLLOUT_CORRECTIONS.register("mis_seq")
def sequence_mis(log_ratio: torch.Tensor, mask: torch.Tensor, params: CorrectionParams) -> RolloutCorrection:
    """Sequence MIS: drop whole sequences whose product ratio leaves [mis_low, mis_high]."""
    keep_seq = _inside(masked_sum(log_ratio, mask, dim=-1), params)
    keep = keep_seq.unsqueeze(-1).expand_as(mask)
    metrics = {
        "rollout/mis_masked_frac": masked_fraction(~keep, mask),
        "rollout/mis_seq_masked_frac": masked_fraction(~keep_seq, mask.any(-1)),
    }
    return RolloutCorrection(None, mask & keep, metrics)


@ROLLOUT_CORRECTIONS.register("icepop")
def icepop(log_ratio: torch.Tensor, mask: torch.Tensor, params: CorrectionParams) -> RolloutCorrection:
    """IcePop: drop tokens outside [mis_low, mis_high], weight the others by rho_t (no cap needed)."""
    keep = _inside(log_ratio, params)
    weights = torch.where(keep, torch.exp(log_ratio), 0)  # M(rho) = rho if C_lo <= rho <= C_hi else 0
    metrics = {
        "rollout/tis_mean": masked_mean(weights, mask & keep),
        "rollout/tis_max": torch.where(mask, weights, 0).max() if weights.numel() else weights.new_zeros(()),
        "rollout/mis_masked_frac": masked_fraction(~keep, mask),
    }
    return RolloutCorrection(weights, mask & keep, metrics)
