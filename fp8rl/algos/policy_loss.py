"""Clipped policy-gradient losses, registered by name; options bound at build, called with tensors only.

``get_policy_loss(name)`` is the registered loss with its default options; ``.configured(...)`` binds the
options once, when the run is built (torchtitan's loss config):

    loss_fn = get_policy_loss("dual_clip").configured(agg="token-mean", dual_clip_c=3.0)
    loss, metrics = loss_fn(logp, tokens, bounds, denominator=None)

with ``logp`` (batch, response_len) the current policy's log-probs, ``tokens`` a :class:`TokenBatch` (old
log-probs, advantages of shape (batch,) or (batch, response_len), the response mask, and the mini-batch's
rollout correction), ``bounds`` = (clip_low, clip_high) in *ratio* space (standard PPO: 1 - eps_low,
1 + eps_high; Calibrated Clipping passes its calibrated bounds), ``denominator`` the aggregation's normaliser
of a global mini-batch (``aggregation.aggregate_loss``; None: this batch's own). ``loss`` is 0-d and
``metrics`` namespaced 0-d detached tensors. A surrogate's own options (``dual_clip_c`` for ``"dual_clip"``)
are keyword parameters of the surrogate; ``configured`` refuses an option the loss does not know
(``TypeError``) before anything runs.

Registered losses (r = exp(logp - old_logp), A = advantage):

- ``"ppo_clip"`` (alias ``"vanilla"``): -min(r A, clip(r, clip_low, clip_high) A) (PPO, Schulman et al.
  2017, eq. 7). Tokens with A < 0 and r <= clip_low, and tokens with A > 0 and r >= clip_high get exactly
  zero gradient (bounds inclusive, ties included: the paper's "zeroed" negative tokens).
- ``"dual_clip"``: PPO clip plus, for A < 0, max(min(r A, clip(r) A), c A) (Ye et al. 2020), c =
  ``dual_clip_c`` = 3: negative tokens with r >= c get zero gradient.
- ``"cispo"``: -sg(clip(r, clip_low, clip_high)) A log pi (MiniMax-M1 2025; the paper's appendix
  baseline): every token keeps its gradient, only its IS weight is clipped. Value -clip(r) A.

The rollout correction (``corrections.py``) is computed once per mini-batch, where the trainer also needs its
mask for the global normaliser, and handed in with the tokens: the per-token loss is multiplied by its
stop-gradient weights and rejected tokens leave the mask. Its metrics, and the BF16-vs-FP8 over-clip metrics
(the BF16 shadow's, ``trainer/shadow.py``), are computed where their inputs live, not here.

Project choices: log r is clamped to [-20, 20] before exp (as verl; beyond it the gradient is zero);
16-bit log-probs are upcast to float32; the clip metrics use the mask after the correction's rejection.
``TokenBatch.grad_zero_mask`` (batch, response_len) bool, an ablation: those tokens keep their loss value but
lose their gradient, as clipped tokens do (the synthetic over-clipping of ``diagnostics.synthetic_overclip_mask``);
its share of the negative-advantage tokens is ``clip/synthetic_overclip_neg``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from fp8rl.algos.aggregation import aggregate_loss
from fp8rl.algos.corrections import RolloutCorrection
from fp8rl.algos.diagnostics import (
    LOG_RATIO_CLAMP,
    clip_fraction_metrics,
    contribution_metrics,
    ratio_quantile_metrics,
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
SURROGATE_ARGS = 5  # (ratio, adv, response_mask, clip_low, clip_high): what follows are the loss's options

# (ratio, adv, response_mask, clip_low, clip_high, **options) -> (per-token loss, extra metrics)
Surrogate = Callable[..., tuple[torch.Tensor, Metrics]]


@dataclass(frozen=True)
class TokenBatch:
    """The tensors a loss reads for one (micro-)batch, each (batch, response_len) unless said.

    ``correction`` is the mini-batch's rollout correction restricted to these rows (None: no correction);
    ``reference_logp`` the frozen reference policy's log-probs (the KL penalty's; None: no penalty)."""

    old_logp: torch.Tensor
    adv: torch.Tensor  # (batch,) or (batch, response_len)
    mask: torch.Tensor  # the response (loss) mask before the correction's rejection
    correction: RolloutCorrection | None = None
    reference_logp: torch.Tensor | None = None
    grad_zero_mask: torch.Tensor | None = None

    def select(self, index: torch.Tensor) -> TokenBatch:
        """These rows only (``index`` a 1-d tensor of row indices)."""
        correction = self.correction
        if correction is not None:
            weights = None if correction.weights is None else correction.weights[index]
            correction = RolloutCorrection(weights, correction.response_mask[index], {})
        return TokenBatch(
            self.old_logp[index],
            self.adv[index],
            self.mask[index],
            correction,
            None if self.reference_logp is None else self.reference_logp[index],
            None if self.grad_zero_mask is None else self.grad_zero_mask[index],
        )

    @property
    def loss_mask(self) -> torch.Tensor:
        """The bool mask the loss aggregates over: after the correction's rejection."""
        return as_bool_mask(self.mask if self.correction is None else self.correction.response_mask)


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss: the shared pipeline (ratio, correction weights, aggregation, metrics) around a
    per-token ``surrogate``, with its options bound (module docstring)."""

    name: str
    surrogate: Surrogate
    agg: str = "token-mean"
    norm_constant: float | None = None  # aggregate_loss's constant for the "*-token-sum-norm" modes
    diagnostics: bool = True
    options: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def option_names(self) -> tuple[str, ...]:
        """The surrogate's own options (its keyword parameters after the five shared ones)."""
        return tuple(inspect.signature(self.surrogate).parameters)[SURROGATE_ARGS:]

    def configured(
        self, *, agg: str | None = None, norm_constant: float | None = None, diagnostics: bool | None = None, **options
    ) -> PolicyLoss:
        """This loss with options bound; an option the surrogate does not take raises ``TypeError``."""
        unknown = sorted(set(options) - set(self.option_names))
        if unknown:
            known = ", ".join(self.option_names) or "none"
            raise TypeError(f"policy loss {self.name!r} takes no option {', '.join(unknown)} (its options: {known})")
        changes = {"options": MappingProxyType({**self.options, **options})}
        for key, value in {"agg": agg, "norm_constant": norm_constant, "diagnostics": diagnostics}.items():
            if value is not None:
                changes[key] = value
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:
        return f"PolicyLoss({self.name!r})"

    def __call__(
        self,
        logp: torch.Tensor,
        tokens: TokenBatch,
        bounds: tuple[float, float],
        denominator: float | None = None,
    ) -> tuple[torch.Tensor, Metrics]:
        names = ("logp", "old_logp", "response_mask")
        check_token_shapes(logp, tokens.old_logp, tokens.mask, names=names)
        clip_low, clip_high = _check_bounds(*bounds)
        mask = as_bool_mask(tokens.mask)
        adv = expand_adv(tokens.adv, logp).detach()
        log_ratio = torch.where(mask, at_least_float32(logp) - at_least_float32(tokens.old_logp).detach(), 0)
        log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = torch.exp(log_ratio)  # r = pi_theta / pi_old
        per_token_loss, surrogate_metrics = self.surrogate(ratio, adv, mask, clip_low, clip_high, **self.options)
        if tokens.grad_zero_mask is not None:
            zeroed = as_bool_mask(tokens.grad_zero_mask) & mask
            per_token_loss = torch.where(zeroed, per_token_loss.detach(), per_token_loss)
            negative = mask & (adv < 0)
            surrogate_metrics["clip/synthetic_overclip_neg"] = masked_fraction(zeroed, negative)
        correction = tokens.correction
        if correction is not None and correction.weights is not None:
            per_token_loss = per_token_loss * correction.weights  # TIS: stop-gradient weight on the token loss
        loss_mask = tokens.loss_mask
        loss = aggregate_loss(
            per_token_loss, loss_mask, self.agg, norm_constant=self.norm_constant, denominator=denominator
        )
        metrics: Metrics = {"actor/pg_loss": loss.detach()}
        if self.diagnostics:
            metrics.update(surrogate_metrics)
            metrics.update(_diagnostics(ratio, log_ratio, adv, loss_mask, clip_low, clip_high))
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
    """Decorator registering a per-token surrogate ``(ratio, adv, mask, clip_low, clip_high, **options)``
    -> (per_token_loss, metrics) as a full :class:`PolicyLoss` under ``name``."""

    def decorator(surrogate: Surrogate) -> Surrogate:
        existing = POLICY_LOSSES.get(name) if name in POLICY_LOSSES else None
        loss = existing if existing is not None and existing.surrogate is surrogate else PolicyLoss(name, surrogate)
        for key in (name, *aliases):
            POLICY_LOSSES.add(key, loss)
        return surrogate

    return decorator


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered loss ``name`` with its default options; unknown names raise ``UnknownNameError``
    listing the valid ones."""
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
