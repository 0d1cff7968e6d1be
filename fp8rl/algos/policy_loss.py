"""Clipped policy-gradient losses, registered by name, all sharing one signature.

``get_policy_loss(name)`` returns a callable

    loss_fn(logp, old_logp, adv, response_mask, *, clip_low, clip_high, agg="token-mean",
            rollout_logp=None, tis_cap=None, rollout_correction=None, mis_low=0.5, mis_high=2.0,
            ratio_ref=None, ref_clip_low=None, ref_clip_high=None, agg_norm_constant=None,
            agg_denominator=None, diagnostics=True, grad_zero_mask=None, **loss_kwargs) -> (loss, metrics)

with logp / old_logp / rollout_logp / response_mask / ratio_ref of shape (batch, response_len), adv of
shape (batch,) or (batch, response_len), bounds in *ratio* space (standard PPO: clip_low = 1 - eps_low,
clip_high = 1 + eps_high; Calibrated Clipping passes its calibrated bounds), ``loss`` 0-d and ``metrics``
namespaced 0-d detached tensors. ``loss_kwargs`` are the loss's own options (``dual_clip_c`` for
``"dual_clip"``); an option a loss does not know raises ``TypeError``.

Registered losses (r = exp(logp - old_logp), A = advantage):

- ``"ppo_clip"`` (alias ``"vanilla"``): -min(r A, clip(r, clip_low, clip_high) A) (PPO, Schulman et al.
  2017, eq. 7). Tokens with A < 0 and r <= clip_low, and tokens with A > 0 and r >= clip_high get exactly
  zero gradient (bounds inclusive, ties included: the paper's "zeroed" negative tokens).
- ``"dual_clip"``: PPO clip plus, for A < 0, max(min(r A, clip(r) A), c A) (Ye et al. 2020), c =
  ``dual_clip_c`` = 3: negative tokens with r >= c get zero gradient.
- ``"cispo"``: -sg(clip(r, clip_low, clip_high)) A log pi (MiniMax-M1 2025; the paper's appendix
  baseline): every token keeps its gradient, only its IS weight is clipped. Value -clip(r) A.

Rollout corrections (``corrections.py``) act on top of any loss: with ``rollout_logp`` given, the
per-token loss is multiplied by the correction's stop-gradient weights and rejected tokens leave the
mask. ``rollout_correction=None`` means token TIS with cap ``tis_cap`` (default C = 2, the paper's setup);
pass ``"none"`` to only log the mismatch, or any registered name / list of names.

Project choices: log r is clamped to [-20, 20] before exp (as verl; beyond it the gradient is zero);
16-bit log-probs are upcast to float32; the clip metrics use the mask after MIS rejection, the
``rollout/`` mismatch metrics the mask before. ``ratio_ref`` (the BF16 shadow ratio) adds the over-clip
metrics, compared against [ref_clip_low, ref_clip_high] (default: [clip_low, clip_high]). ``grad_zero_mask``
(batch, response_len) bool, an ablation: those tokens keep their loss value but lose their gradient, as
clipped tokens do (the synthetic over-clipping of ``diagnostics.synthetic_overclip_mask``); its share of the
negative-advantage tokens is ``clip/synthetic_overclip_neg``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fp8rl.algos.aggregation import aggregate_loss
from fp8rl.algos.corrections import DEFAULT_MIS_HIGH, DEFAULT_MIS_LOW, apply_rollout_correction
from fp8rl.algos.diagnostics import (
    LOG_RATIO_CLAMP,
    clip_fraction_metrics,
    contribution_metrics,
    overclip_metrics,
    ratio_quantile_metrics,
    rollout_mismatch_metrics,
)
from fp8rl.algos.masked import (
    Metrics,
    as_bool_mask,
    at_least_float32,
    check_token_shapes,
    expand_adv,
    masked_fraction,
    masked_mean,
)
from fp8rl.algos.registry import Registry

DEFAULT_DUAL_CLIP_C = 3.0

# (ratio, adv, response_mask, clip_low, clip_high, **options) -> (per-token loss, extra metrics)
Surrogate = Callable[..., tuple[torch.Tensor, Metrics]]


class PolicyLoss:
    """A registered policy loss: the shared pipeline (ratio, correction, aggregation, metrics) around a
    per-token ``surrogate``. Call it with the signature in the module docstring."""

    def __init__(self, name: str, surrogate: Surrogate) -> None:
        self.name = name
        self.surrogate = surrogate
        self.__doc__ = surrogate.__doc__

    def __repr__(self) -> str:
        return f"PolicyLoss({self.name!r})"

    def __call__(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        adv: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        clip_low: float,
        clip_high: float,
        agg: str = "token-mean",
        rollout_logp: torch.Tensor | None = None,
        tis_cap: float | None = None,
        rollout_correction: str | Sequence[str] | None = None,
        mis_low: float = DEFAULT_MIS_LOW,
        mis_high: float = DEFAULT_MIS_HIGH,
        ratio_ref: torch.Tensor | None = None,
        ref_clip_low: float | None = None,
        ref_clip_high: float | None = None,
        agg_norm_constant: float | None = None,
        agg_denominator: float | None = None,
        diagnostics: bool = True,
        grad_zero_mask: torch.Tensor | None = None,
        **loss_kwargs,
    ) -> tuple[torch.Tensor, Metrics]:
        token_tensors = {"logp": logp, "old_logp": old_logp, "response_mask": response_mask}
        token_tensors.update(rollout_logp=rollout_logp, ratio_ref=ratio_ref)
        check_token_shapes(*token_tensors.values(), names=tuple(token_tensors))
        clip_low, clip_high = _check_bounds(clip_low, clip_high)
        mask = as_bool_mask(response_mask)
        adv = expand_adv(adv, logp).detach()
        log_ratio = torch.where(mask, at_least_float32(logp) - at_least_float32(old_logp).detach(), 0)
        log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = torch.exp(log_ratio)  # r = pi_theta / pi_old
        per_token_loss, surrogate_metrics = self.surrogate(ratio, adv, mask, clip_low, clip_high, **loss_kwargs)
        if grad_zero_mask is not None:
            zeroed = as_bool_mask(grad_zero_mask) & mask
            per_token_loss = torch.where(zeroed, per_token_loss.detach(), per_token_loss)
            negative = mask & (adv < 0)
            surrogate_metrics["clip/synthetic_overclip_neg"] = masked_fraction(zeroed, negative)

        correction = apply_rollout_correction(
            old_logp, rollout_logp, mask, rollout_correction, tis_cap=tis_cap, mis_low=mis_low, mis_high=mis_high
        )
        if correction.weights is not None:
            per_token_loss = per_token_loss * correction.weights  # TIS: stop-gradient weight on the token loss
        loss_mask = correction.response_mask
        loss = aggregate_loss(
            per_token_loss, loss_mask, agg, norm_constant=agg_norm_constant, denominator=agg_denominator
        )

        metrics: Metrics = {"actor/pg_loss": loss.detach(), **correction.metrics}
        if diagnostics:
            metrics.update(surrogate_metrics)
            metrics.update(_diagnostics(ratio, log_ratio, adv, loss_mask, clip_low, clip_high))
            if rollout_logp is not None:
                metrics.update(rollout_mismatch_metrics(old_logp, rollout_logp, mask))
            if ratio_ref is not None:
                ref_low = clip_low if ref_clip_low is None else ref_clip_low
                ref_high = clip_high if ref_clip_high is None else ref_clip_high
                bounds = (clip_low, clip_high, ref_low, ref_high)
                overclip = overclip_metrics(ratio_ref, ratio, adv, loss_mask, *bounds, with_fp8_contributions=False)
                metrics.update(overclip)
        return loss, metrics


def _check_bounds(clip_low: float, clip_high: float) -> tuple[float, float]:
    clip_low, clip_high = float(clip_low), float(clip_high)
    if not 0.0 <= clip_low <= clip_high:
        raise ValueError(f"need 0 <= clip_low <= clip_high (ratio space), got [{clip_low}, {clip_high}]")
    return clip_low, clip_high


@torch.no_grad()
def _diagnostics(ratio, log_ratio, adv, mask, clip_low, clip_high) -> Metrics:
    metrics = clip_fraction_metrics(ratio, adv, mask, clip_low, clip_high)
    metrics.update(contribution_metrics(ratio, adv, mask, clip_low, clip_high))
    metrics.update(ratio_quantile_metrics(ratio, mask))
    metrics["actor/ppo_kl"] = masked_mean(-log_ratio.detach(), mask)  # k1 estimate of KL(pi_old || pi_theta)
    return metrics


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def register_policy_loss(name: str, *aliases: str) -> Callable[[Surrogate], Surrogate]:
    """Decorator registering a per-token surrogate ``(ratio, adv, mask, clip_low, clip_high, **kw)``
    -> (per_token_loss, metrics) as a full :class:`PolicyLoss` under ``name``."""

    def decorator(surrogate: Surrogate) -> Surrogate:
        existing = POLICY_LOSSES.get(name) if name in POLICY_LOSSES else None
        loss = existing if existing is not None and existing.surrogate is surrogate else PolicyLoss(name, surrogate)
        for key in (name, *aliases):
            POLICY_LOSSES.add(key, loss)
        return surrogate

    return decorator


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered loss ``name``; unknown names raise ``UnknownNameError`` listing the valid ones."""
    return POLICY_LOSSES.get(name)


def _ppo_zeroed(ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    """Tokens where PPO's clipped branch is active: A < 0 with r <= low, A > 0 with r >= high."""
    return ((adv < 0) & (ratio <= clip_low)) | ((adv > 0) & (ratio >= clip_high))


@register_policy_loss("ppo_clip", "vanilla")
def ppo_clip_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, response_mask: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, Metrics]:
    """PPO clip: per-token loss -min(r A, clip(r, clip_low, clip_high) A) (Schulman et al. 2017, eq. 7)."""
    # The clipped branch is a constant (detached) so the zero gradient is exact, ties at the bound included;
    # torch.maximum / clamp would both pass gradient at r == bound.
    zeroed = _ppo_zeroed(ratio, adv, clip_low, clip_high)
    effective_ratio = torch.where(zeroed, ratio.detach().clamp(clip_low, clip_high), ratio)
    return -adv * effective_ratio, {}


@register_policy_loss("dual_clip")
def dual_clip_surrogate(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float = DEFAULT_DUAL_CLIP_C,
) -> tuple[torch.Tensor, Metrics]:
    """Dual-clip PPO: for A < 0, -max(min(r A, clip(r) A), c A), i.e. the loss is capped at -c A (Ye et al.
    2020, eq. 5); A >= 0 as PPO clip."""
    if not dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    zeroed = _ppo_zeroed(ratio, adv, clip_low, clip_high)
    dual = (adv < 0) & (ratio >= dual_clip_c) & ~zeroed
    effective_ratio = torch.where(zeroed, ratio.detach().clamp(clip_low, clip_high), ratio)
    effective_ratio = torch.where(dual, torch.full_like(ratio, dual_clip_c), effective_ratio)  # loss = -c A
    negative = response_mask & (adv < 0)
    dual_frac = (dual & negative).sum().float() / negative.sum().clamp(min=1).float()
    return -adv * effective_ratio, {"clip/dual_neg": dual_frac.detach()}


@register_policy_loss("cispo")
def cispo_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, response_mask: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, Metrics]:
    """CISPO: -sg(clip(r, clip_low, clip_high)) A log pi; gradient -clip(r) A grad log pi, never zeroed
    (MiniMax-M1, 2025, eq. 4). Written as -sg(clip(r)) A r / sg(r) so the value is -clip(r) A."""
    weight = ratio.detach().clamp(clip_low, clip_high)
    return -adv * weight * (ratio / ratio.detach()), {}
