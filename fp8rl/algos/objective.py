"""The RL objective of a run, fixed when the run is built and then called with tensors only.

One :class:`Objective` holds the policy loss with its options, the rollout correction, the KL penalty and the
entropy bonus (verl computes the correction once, centrally; torchtitan binds a loss's options at build).
Per mini-batch the trainer calls ``correct`` once (the correction's weights and rejection mask, and the
train/rollout mismatch metrics) and ``count`` (this rank's share of the global normaliser); per micro-batch
it calls the objective itself:

    loss, metrics = objective(logp, entropy, tokens, bounds, denominator)

loss = policy loss + kl_coef * KL(pi || pi_ref) - entropy_coef * entropy, each aggregated as the policy loss
is and normalised by ``denominator`` (the global mini-batch's). ``metrics`` are 0-d detached tensors:
the policy loss's, ``actor/kl_loss`` with a KL penalty, and ``actor/loss``, ``actor/entropy`` (mean over the
masked tokens) and ``train/tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8rl.algos.aggregation import aggregate_loss, aggregation_count
from fp8rl.algos.corrections import CorrectionParams, RolloutCorrection, apply_rollout_correction
from fp8rl.algos.diagnostics import rollout_mismatch_metrics
from fp8rl.algos.kl import get_kl_estimator, kl_loss
from fp8rl.algos.masked import Metrics, as_bool_mask
from fp8rl.algos.policy_loss import PolicyLoss, TokenBatch


@dataclass(frozen=True)
class Objective:
    """Policy loss (options bound), rollout correction, KL penalty and entropy bonus (module docstring)."""

    policy_loss: PolicyLoss
    correction: str | tuple[str, ...] | None = "none"  # registered correction(s), in order (apply_rollout_correction)
    correction_params: CorrectionParams = CorrectionParams()
    kl_coef: float = 0.0  # > 0 needs TokenBatch.reference_logp
    kl_type: str = "low_var_kl"
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.kl_coef:
            get_kl_estimator(self.kl_type)  # an unknown estimator fails at build, listing the valid ones

    @property
    def agg(self) -> str:
        return self.policy_loss.agg

    def correct(
        self, old_logp: torch.Tensor, rollout_logp: torch.Tensor | None, mask: torch.Tensor
    ) -> RolloutCorrection:
        """The mini-batch's rollout correction (weights, mask after rejection) and, with rollout log-probs, its
        ``rollout/`` metrics: the correction's and the train/rollout mismatch (over the mask before rejection)."""
        p = self.correction_params
        options = {"tis_cap": p.tis_cap, "mis_low": p.mis_low, "mis_high": p.mis_high}
        corrected = apply_rollout_correction(old_logp, rollout_logp, mask, self.correction, **options)
        if rollout_logp is None or not self.policy_loss.diagnostics:
            return corrected
        metrics = {**corrected.metrics, **rollout_mismatch_metrics(old_logp, rollout_logp, as_bool_mask(mask))}
        return RolloutCorrection(corrected.weights, corrected.response_mask, metrics)

    def count(self, correction: RolloutCorrection) -> float:
        """This batch's share of the aggregation's normaliser (summed over ranks: the global denominator)."""
        return aggregation_count(correction.response_mask, self.agg)

    def __call__(
        self,
        logp: torch.Tensor,
        entropy: torch.Tensor,
        tokens: TokenBatch,
        bounds: tuple[float, float],
        denominator: float | None = None,
    ) -> tuple[torch.Tensor, Metrics]:
        loss, metrics = self.policy_loss(logp, tokens, bounds, denominator)
        mask = tokens.mask
        if self.kl_coef:
            if tokens.reference_logp is None:
                raise ValueError("a KL penalty (kl_coef > 0) needs the reference policy's log-probs")
            kl, kl_metrics = kl_loss(
                logp, tokens.reference_logp, mask, kind=self.kl_type, agg=self.agg, denominator=denominator
            )
            loss = loss + self.kl_coef * kl
            metrics.update(kl_metrics)
        if self.entropy_coef:
            loss = loss - self.entropy_coef * aggregate_loss(entropy, mask, self.agg, denominator=denominator)
        metrics["actor/loss"] = loss.detach()
        metrics["actor/entropy"] = (entropy.detach() * mask).sum() / mask.sum().clamp(min=1)
        metrics["train/tokens"] = mask.sum()
        return loss, metrics
