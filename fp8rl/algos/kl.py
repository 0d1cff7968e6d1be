"""Per-token KL penalties to a reference policy (Schulman's k1/k2/k3 estimators, as in verl).

With log_ratio = logp - ref_logp (samples drawn from the current policy):

- ``"k1"`` (alias ``"kl"``): logp - ref_logp.
- ``"k2"`` (alias ``"mse"``): 0.5 * (logp - ref_logp)^2.
- ``"k3"`` (alias ``"low_var_kl"``): exp(ref_logp - logp) - (ref_logp - logp) - 1, with ref_logp - logp
  clamped to [-20, 20] before the exp and the result clamped to [-10, 10], as verl does.

The trainer adds ``coef * aggregate_loss(kl_penalty(...), response_mask, agg)``; :func:`kl_loss` does that
aggregation and reports ``actor/kl_loss``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fp8rl.algos.aggregation import aggregate_loss
from fp8rl.algos.masked import Metrics, at_least_float32
from fp8rl.algos.registry import Registry

K3_LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")


def get_kl_estimator(name: str) -> KLEstimator:
    """The per-token estimator ``(logp, ref_logp) -> kl`` registered as ``name``."""
    return KL_ESTIMATORS.get(name)


@KL_ESTIMATORS.register("k1", "kl")
def k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = logp - ref_logp (unbiased, high variance)."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k2", "mse")
def k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * (logp - ref_logp)^2."""
    return 0.5 * (logp - ref_logp).square()


@KL_ESTIMATORS.register("k3", "low_var_kl")
def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref - logp) - (ref - logp) - 1, clamped like verl's ``low_var_kl``."""
    log_ratio = (ref_logp - logp).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return (torch.exp(log_ratio) - log_ratio - 1).clamp(-K3_CLAMP, K3_CLAMP)  # Schulman 2020, k3


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate (batch, response_len) from (batch, response_len) log-probs."""
    return get_kl_estimator(kind)(at_least_float32(logp), at_least_float32(ref_logp))


def kl_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kind: str = "low_var_kl",
    agg: str = "token-mean",
    denominator: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Aggregated KL penalty (0-d, unscaled by the coefficient) and ``{"actor/kl_loss": ...}``; `denominator`
    as in :func:`aggregate_loss` (a global mini-batch's normaliser)."""
    loss = aggregate_loss(kl_penalty(logp, ref_logp, kind), response_mask, agg, denominator=denominator)
    return loss, {"actor/kl_loss": loss.detach()}
