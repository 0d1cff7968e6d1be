"""RL maths for full-pipeline FP8 training: advantages, losses, rollout corrections, Calibrated Clipping
and diagnostics. Pure functions of tensors (torch and the standard library only); every loss returns
``(loss, metrics)`` with namespaced metric keys (``actor/``, ``clip/``, ``fp8/``, ``rollout/``) whose values
are 0-d detached tensors (:func:`metrics_to_floats` converts a dict for logging).

Registries (look-up by the name a config gives; unknown names raise listing the valid ones):
``ADVANTAGE_ESTIMATORS``, ``POLICY_LOSSES``, ``ROLLOUT_CORRECTIONS``, ``KL_ESTIMATORS``,
``CLIP_BOUND_POLICIES``.
"""

from fp8rl.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    broadcast_to_tokens,
    compute_advantages,
    get_advantage_estimator,
    grpo_advantages,
    rloo_advantages,
)
from fp8rl.algos.aggregation import AGGREGATION_MODES, aggregate_loss, aggregation_count
from fp8rl.algos.calibration import (
    CLIP_BOUND_POLICIES,
    CalibratedClipBounds,
    Calibration,
    CalibStatus,
    ClipBoundPolicy,
    ClipBounds,
    StandardClipBounds,
    calibrate,
    calibrate_clip_bounds,
    get_clip_bound_policy,
    make_clip_bound_policy,
    solve_upper_bound,
    standard_bounds,
)
from fp8rl.algos.corrections import (
    ROLLOUT_CORRECTIONS,
    CorrectionParams,
    RolloutCorrection,
    apply_rollout_correction,
    get_rollout_correction,
)
from fp8rl.algos.dapo import GroupFilter, filter_uniform_groups, overlong_penalty
from fp8rl.algos.diagnostics import (
    P_OLD_BUCKETS,
    RATIO_QUANTILES,
    class_overclip_metrics,
    clip_fraction_metrics,
    clip_overlap_metrics,
    contribution_metrics,
    entropy_from_logits,
    entropy_metrics,
    offpolicy_metrics,
    offpolicy_statistics,
    overclip_breakdown_counts,
    overclip_metrics,
    p_old_bucket_names,
    p_old_groups,
    ratio_quantile_metrics,
    rollout_mismatch_metrics,
    sign_contributions,
    synthetic_class_drop_mask,
    synthetic_overclip_mask,
)
from fp8rl.algos.kl import KL_ESTIMATORS, get_kl_estimator, kl_loss, kl_penalty
from fp8rl.algos.masked import Metrics, masked_mean, masked_quantiles, metrics_to_floats
from fp8rl.algos.objective import Objective
from fp8rl.algos.policy_loss import POLICY_LOSSES, PolicyLoss, TokenBatch, get_policy_loss, register_policy_loss
from fp8rl.algos.registry import Registry, UnknownNameError, declared_options

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "CLIP_BOUND_POLICIES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "P_OLD_BUCKETS",
    "RATIO_QUANTILES",
    "ROLLOUT_CORRECTIONS",
    "CalibStatus",
    "CalibratedClipBounds",
    "Calibration",
    "ClipBoundPolicy",
    "ClipBounds",
    "CorrectionParams",
    "GroupFilter",
    "Metrics",
    "Objective",
    "PolicyLoss",
    "Registry",
    "RolloutCorrection",
    "StandardClipBounds",
    "TokenBatch",
    "UnknownNameError",
    "aggregate_loss",
    "aggregation_count",
    "apply_rollout_correction",
    "broadcast_to_tokens",
    "calibrate",
    "calibrate_clip_bounds",
    "clip_fraction_metrics",
    "compute_advantages",
    "declared_options",
    "contribution_metrics",
    "entropy_from_logits",
    "entropy_metrics",
    "filter_uniform_groups",
    "get_advantage_estimator",
    "get_clip_bound_policy",
    "get_kl_estimator",
    "get_policy_loss",
    "get_rollout_correction",
    "grpo_advantages",
    "kl_loss",
    "kl_penalty",
    "make_clip_bound_policy",
    "masked_mean",
    "masked_quantiles",
    "metrics_to_floats",
    "clip_overlap_metrics",
    "class_overclip_metrics",
    "overclip_breakdown_counts",
    "overclip_metrics",
    "p_old_bucket_names",
    "p_old_groups",
    "overlong_penalty",
    "ratio_quantile_metrics",
    "register_policy_loss",
    "rloo_advantages",
    "offpolicy_metrics",
    "offpolicy_statistics",
    "rollout_mismatch_metrics",
    "sign_contributions",
    "synthetic_class_drop_mask",
    "synthetic_overclip_mask",
    "solve_upper_bound",
    "standard_bounds",
]
