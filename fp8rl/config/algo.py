"""The RL objective's sections: the algorithm (GRPO and DAPO are presets of it) and the clip bounds."""

from __future__ import annotations

from dataclasses import dataclass

from fp8rl.config.fields import _one_of, _require, option

SYNTHETIC_DROP_CLASSES = ("junk", "matched_other")  # clipping.synthetic_drop_class


@dataclass(frozen=True)
class AlgoConfig:
    """The RL objective (GRPO and DAPO are presets of these fields)."""

    name: str = option("grpo", "label of the preset (grpo, dapo)")
    advantage: str = option("grpo", "advantage estimator (registry: grpo, rloo)")
    norm_adv_by_std: bool = option(True, "GRPO's std normalization; false = Dr.GRPO")
    policy_loss: str = option(
        "dual_clip", "policy loss (registry: ppo_clip, dual_clip, cispo); verl's PPO loss is dual-clip, c = 3"
    )
    eps_low: float = option(0.2, "standard lower clip bound is 1 - eps_low")
    eps_high: float = option(0.2, "standard upper clip bound is 1 + eps_high (DAPO clip-higher: 0.28)")
    dual_clip_c: float = option(3.0, "dual-clip constant c (policy_loss=dual_clip)")
    loss_agg: str = option("token-mean", "loss aggregation (token-mean, seq-mean-token-mean, ...); verl's default")
    kl_coef: float = option(0.0, "weight of the KL penalty to the reference (start) policy; 0 = off")
    kl_type: str = option("low_var_kl", "KL estimator (registry: k1, k2, low_var_kl)")
    dynamic_sampling: bool = option(False, "DAPO: drop groups whose rewards are all equal")
    resample_rounds: int = option(
        0, "DAPO: extra rollout rounds that refill the batch with kept groups", neutral=(None, 0)
    )
    overlong_buffer: int = option(0, "DAPO overlong shaping buffer in tokens; 0 = off")
    overlong_factor: float = option(1.0, "DAPO overlong penalty factor")
    group_size: int = option(8, "G responses per prompt")
    prompts_per_step: int = option(32, "prompts per RL step (batch = prompts_per_step x group_size)")
    num_minibatches: int = option(4, "PPO mini-batch updates per step (>= 2 for calibrated clipping)")
    ppo_epochs: int = option(1, "passes over the step's batch")
    lr: float = option(1e-5, "AdamW learning rate")
    weight_decay: float = option(0.0, "AdamW weight decay")
    grad_clip: float = option(1.0, "max global grad norm")
    entropy_coef: float = option(0.0, "entropy bonus weight (0 = off, as in the paper)")

    def __post_init__(self) -> None:
        _require(self.group_size >= 2, f"algo.group_size={self.group_size}: group advantages need >= 2 samples")
        for name in ("prompts_per_step", "num_minibatches", "ppo_epochs"):
            value = getattr(self, name)
            _require(value >= 1, f"algo.{name}={value} must be >= 1")
        batch = self.prompts_per_step * self.group_size
        _require(
            batch % self.num_minibatches == 0,
            f"batch {batch} (algo.prompts_per_step * algo.group_size) is not divisible by "
            f"algo.num_minibatches={self.num_minibatches}; change one of them",
        )
        _require(
            (batch // self.num_minibatches) % self.group_size == 0,
            f"a mini-batch of {batch // self.num_minibatches} sequences splits groups of {self.group_size}; make "
            "algo.prompts_per_step divisible by algo.num_minibatches",
        )
        _require(
            0 < self.eps_low < 1 and self.eps_high > 0,
            f"need 0 < algo.eps_low < 1 and algo.eps_high > 0, got {self.eps_low}, {self.eps_high}",
        )
        _require(self.lr > 0, f"algo.lr={self.lr} must be > 0")
        _require(self.kl_coef >= 0, f"algo.kl_coef={self.kl_coef} must be >= 0")
        _require(self.grad_clip > 0, f"algo.grad_clip={self.grad_clip} must be > 0")
        _require(self.dual_clip_c > 1, f"algo.dual_clip_c={self.dual_clip_c} must be > 1")
        _require(
            self.resample_rounds >= 0 and (self.resample_rounds == 0 or self.dynamic_sampling),
            f"algo.resample_rounds={self.resample_rounds}: refilling needs algo.dynamic_sampling=true and a count >= 0",
        )
        _require(self.overlong_buffer >= 0, f"algo.overlong_buffer={self.overlong_buffer} must be >= 0")

    @property
    def batch_size(self) -> int:
        """Sequences per RL step."""
        return self.prompts_per_step * self.group_size


@dataclass(frozen=True)
class ClippingConfig:
    """Clip bounds (standard or Calibrated Clipping) and rollout corrections."""

    policy: str = option("standard", "clip-bound policy (registry: standard, calibrated)")
    interval: int = option(20, "calibrated: recalibrate every K steps (paper: 20)")
    first_step: int | None = option(
        None,
        "calibrated: index of the step (0 = the first) whose shadow gives the first calibration, in force from "
        "the next step; then every K steps (None = K: the first K + 1 steps run at the initial bounds)",
        neutral=(None,),
    )
    init_low: float | None = option(None, "calibrated: lower bound before the first calibration (None = 1 - eps_low)")
    init_high: float | None = option(None, "calibrated: upper bound before the first calibration (None = 1 + eps_high)")
    ema: float = option(0.5, "calibrated: smoothing, bound = ema * old + (1 - ema) * calibrated")
    lower_only: bool = option(False, "calibrated: ablation that calibrates only the lower bound")
    pool_neg_tokens: int = option(
        0,
        "calibrated: a calibration also pools the newest earlier shadow steps until it holds this many "
        "negative-advantage tokens (0 = its own step only, the paper's rule at its batch sizes)",
        neutral=(0,),
    )
    rollout_correction: str = option("none", "none, or a correction (registry: tis_token, tis_seq, mis_*, icepop)")
    tis_cap: float = option(2.0, "TIS truncation C")
    mis_low: float = option(0.5, "MIS / IcePop: keep tokens whose rollout ratio is >= mis_low")
    mis_high: float = option(2.0, "MIS / IcePop: keep tokens whose rollout ratio is <= mis_high")
    synthetic_overclip_std: float = option(
        0.0,
        "ablation (positive control), 0 = off: a negative-advantage token loses its gradient when its log-ratio "
        "plus N(0, std^2) noise falls to log(clip low) or below, as FP8 noise of that size would do",
        neutral=(0.0,),
    )
    synthetic_drop_neg: float = option(
        0.0,
        "ablation (the junk organism's controls), 0 = off: each negative-advantage token of synthetic_drop_class "
        "loses its gradient with this probability, as over-clipping that targets it would do",
        neutral=(0.0,),
    )
    synthetic_drop_class: str = option(
        "junk",
        "synthetic_drop_neg's target: junk (the task's junk tokens) or matched_other (as many non-junk "
        "negative-advantage tokens, drawn uniformly, as the junk rule would drop: targeting vs count)",
        neutral=("junk",),
    )

    def __post_init__(self) -> None:
        _require(self.interval >= 1, f"clipping.interval={self.interval} must be >= 1")
        _require(
            self.first_step is None or self.first_step >= 0,
            f"clipping.first_step={self.first_step} must be >= 0 (0 = the first step), or null for the interval",
        )
        _require(self.synthetic_overclip_std >= 0, "clipping.synthetic_overclip_std must be >= 0")
        _require(
            0 <= self.synthetic_drop_neg <= 1, f"clipping.synthetic_drop_neg={self.synthetic_drop_neg} not in [0, 1]"
        )
        _one_of(self.synthetic_drop_class, SYNTHETIC_DROP_CLASSES, "clipping.synthetic_drop_class")
        _require(0 <= self.ema < 1, f"clipping.ema={self.ema} must be in [0, 1)")
        _require(self.pool_neg_tokens >= 0, f"clipping.pool_neg_tokens={self.pool_neg_tokens} must be >= 0")
        _require(self.tis_cap > 0, f"clipping.tis_cap={self.tis_cap} must be > 0")
        _require(0 < self.mis_low < 1 < self.mis_high, "need 0 < clipping.mis_low < 1 < clipping.mis_high")
