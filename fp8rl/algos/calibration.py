"""Calibrated Clipping: FP8 clip bounds aligned with the BF16 clipping behaviour.

``calibrate_clip_bounds(ratio_ref, ratio_fp8, adv, mask, eps_low, eps_high) -> ClipBounds(low, high)``
takes the BF16 "shadow" ratio and the FP8 ratio of the same tokens (batch, response_len), advantages
(batch,) or (batch, response_len) and the response mask; ``low`` / ``high`` are python floats in ratio
space. :func:`calibrate` returns the same bounds plus what happened (:class:`Calibration`).
The stateful policies the trainer uses (``"standard"``, ``"calibrated"``) are at the end of the module.

What follows the paper (arXiv 2609.22870, as summarised in PAPER.md)
--------------------------------------------------------------------
1. Lower bound: alpha_low = #{A < 0, ratio_ref <= 1 - eps_low} / #{A < 0} over masked tokens, and ``low``
   is the alpha_low empirical quantile of ratio_fp8 over the same negative-advantage tokens, so FP8 clips
   as many negative tokens as BF16 would.
2. Upper bound: ``high`` makes p = (positive contribution) / (negative contribution) in FP8 (with low,
   high) equal p in BF16 (ratio_ref with the standard bounds 1 - eps_low, 1 + eps_high).
3. Bounds are recomputed every K = 20 steps, held in between, and smoothed.

Project choices (the paper's text is not available; each is a documented default)
---------------------------------------------------------------------------------
- Contribution of a sign = sum of |A| r over the masked tokens of that sign that carry gradient
  (A < 0: r > low; A > 0: r < high), see ``diagnostics.sign_contributions``.
- Quantile convention: with n negative tokens of which k = alpha_low * n (an integer: the BF16 count)
  are clipped in BF16, ``low`` is the k-th smallest FP8 ratio of the negative tokens, so exactly k FP8
  tokens satisfy r <= low when the ratios are distinct (ties may add tokens at the same value).
- Upper-bound solve, exact and without trial (one sort + cumulative sums): the positive contribution as a
  function of ``high`` is a step function over the sorted positive ratios s_1 <= ... <= s_m; high in
  (s_j, s_{j+1}] gives C_j = sum_{i <= j} A_i s_i. The target is T = p_BF16 * contrib_neg_FP8. We pick the
  achievable step j with |C_j - T| minimal (no interpolation inside a step: the token at a step is either
  clipped or not), ties broken towards the step whose ``high`` is nearest 1 + eps_high; within the chosen
  interval ``high`` is the point nearest 1 + eps_high (1 + eps_high itself when it lies in the interval).
  ``high`` is at least max(``min_high``, low), min_high = 1.0 by default (positive tokens at r <= 1, the
  on-policy side, always keep their gradient; they are a constant part of every C_j and are not sorted).
  Ratios are compared with the bounds in their own dtype (float32 for 16-bit inputs) and ``high`` is a
  value of that dtype, so a token exactly at a step lands on the intended side.
- Degenerate cases never give NaN; each sets a :class:`CalibStatus` flag:
  EMPTY (no masked token): both bounds standard. NO_NEG (no negative token): low standard.
  ALPHA_ZERO (BF16 clips no negative token): low = min(1 - eps_low, largest float below the smallest FP8
  negative ratio), so FP8 clips none either. NO_POS (no positive token): high standard.
  NO_REF_NEG_CONTRIB / NO_NEG_CONTRIB (BF16 / FP8 negative contribution is 0, p undefined): high
  standard. P_UNREACHABLE: the target lies outside the reachable contributions; the closest end is used.
- The stateful policy smooths with an EMA, bound <- ema * bound + (1 - ema) * calibrated, default
  ema = 0.5 (0 = jump to the calibrated value); the first calibration uses the shadow of step K (steps count
  from 0; ``first_step`` moves it) and applies from the next step, so steps 0..K run at the initial bounds
  (default the standard bounds); then every K steps.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Protocol

import torch

from fp8rl.algos.diagnostics import sign_contributions
from fp8rl.algos.masked import Metrics, as_bool_mask, at_least_float32, check_token_shapes, expand_adv
from fp8rl.algos.registry import Registry


class ClipBounds(NamedTuple):
    """Clip bounds in ratio space; unpacks as ``low, high = bounds``."""

    low: float
    high: float


class CalibStatus(enum.IntFlag):
    """What happened during a calibration; 0 = OK. Logged as the integer ``clip/calib_status``."""

    OK = 0
    EMPTY = 1
    NO_NEG = 2
    ALPHA_ZERO = 4
    NO_POS = 8
    NO_REF_NEG_CONTRIB = 16
    NO_NEG_CONTRIB = 32
    P_UNREACHABLE = 64


@dataclass(frozen=True)
class Calibration:
    """Result of :func:`calibrate`: the bounds and how they were obtained."""

    bounds: ClipBounds
    status: CalibStatus
    alpha_low: float  # fraction of negative tokens clipped by BF16 at 1 - eps_low
    ref_p: float  # BF16 p with the standard bounds (the target)
    p: float  # FP8 p with the calibrated bounds
    fp8_alpha_low_standard: float  # fraction of negative tokens FP8 would clip at 1 - eps_low (over-clipping)
    n_neg: int
    n_pos: int

    def summary(self) -> dict[str, float]:
        """Loggable numbers: raw (unsmoothed) bounds, status code, alpha_low, p and ref_p, FP8 over-clipping."""
        return {
            "raw_low": self.bounds.low,
            "raw_high": self.bounds.high,
            "status": float(int(self.status)),
            "alpha_low": self.alpha_low,
            "ref_p": self.ref_p,
            "p": self.p,
            "fp8_low_neg_standard": self.fp8_alpha_low_standard,
        }

    def metrics(self, prefix: str = "clip/calib_") -> Metrics:
        """:meth:`summary` as metrics (``clip/calib_*``, 0-d tensors)."""
        return _as_metrics({prefix + key: value for key, value in self.summary().items()})


def _as_metrics(values: Mapping[str, float]) -> Metrics:
    """Python numbers -> 0-d float64 tensors (exact for the float bounds)."""
    return {key: torch.tensor(float(value), dtype=torch.float64) for key, value in values.items()}


def standard_bounds(eps_low: float, eps_high: float) -> ClipBounds:
    """PPO's [1 - eps_low, 1 + eps_high]."""
    return ClipBounds(1.0 - eps_low, 1.0 + eps_high)


def calibrate_clip_bounds(
    ratio_ref: torch.Tensor,
    ratio_fp8: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    *,
    calibrate_high: bool = True,
    min_high: float = 1.0,
) -> ClipBounds:
    """Calibrated FP8 clip bounds (low, high) as python floats; arguments as :func:`calibrate`."""
    options = {"calibrate_high": calibrate_high, "min_high": min_high}
    return calibrate(ratio_ref, ratio_fp8, adv, mask, eps_low, eps_high, **options).bounds


def calibrate(
    ratio_ref: torch.Tensor,
    ratio_fp8: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    *,
    calibrate_high: bool = True,
    min_high: float = 1.0,
) -> Calibration:
    """Calibrate the FP8 clip bounds against the BF16 shadow ratios (module docstring).

    Args:
        ratio_ref: (batch, response_len) BF16 ratio pi_theta / pi_old.
        ratio_fp8: (batch, response_len) FP8 ratio of the same tokens.
        adv: (batch,) or (batch, response_len) advantages.
        mask: (batch, response_len) response mask.
        eps_low, eps_high: the standard PPO clip range [1 - eps_low, 1 + eps_high] BF16 uses.
        calibrate_high: False keeps high = 1 + eps_high (the "lower-bound-only" ablation).
        min_high: floor for the calibrated upper bound.
    """
    check_token_shapes(ratio_ref, ratio_fp8, mask, names=("ratio_ref", "ratio_fp8", "mask"))
    if not (0.0 < eps_low < 1.0 and eps_high > 0.0):
        raise ValueError(f"need 0 < eps_low < 1 and eps_high > 0, got eps_low={eps_low}, eps_high={eps_high}")
    standard = standard_bounds(eps_low, eps_high)
    mask = as_bool_mask(mask)
    adv = expand_adv(adv, ratio_fp8).detach()
    ratio_ref, ratio_fp8 = at_least_float32(ratio_ref.detach()), at_least_float32(ratio_fp8.detach())
    negative, positive = mask & (adv < 0), mask & (adv > 0)
    n_neg, n_pos = int(negative.sum()), int(positive.sum())
    status = CalibStatus.OK if bool(mask.any()) else CalibStatus.EMPTY

    low, alpha_low, fp8_alpha_standard, low_status = _lower_bound(ratio_ref, ratio_fp8, negative, n_neg, standard.low)
    status |= low_status
    high, ref_p, p, high_status = _upper_bound(
        ratio_ref, ratio_fp8, adv, mask, positive, n_pos, standard, low, calibrate_high, min_high
    )
    status |= high_status
    return Calibration(ClipBounds(low, high), status, alpha_low, ref_p, p, fp8_alpha_standard, n_neg, n_pos)


def _lower_bound(
    ratio_ref: torch.Tensor, ratio_fp8: torch.Tensor, negative: torch.Tensor, n_neg: int, standard_low: float
) -> tuple[float, float, float, CalibStatus]:
    """(low, alpha_low, FP8 fraction clipped at the standard low, status) from the negative tokens."""
    if n_neg == 0:
        return standard_low, 0.0, 0.0, CalibStatus.NO_NEG
    fp8_negative = ratio_fp8[negative]
    k = int((ratio_ref[negative] <= standard_low).sum())  # alpha_low * n: tokens BF16 clips
    fp8_alpha_standard = int((fp8_negative <= standard_low).sum()) / n_neg
    if k == 0:
        below_min = torch.nextafter(fp8_negative.min(), fp8_negative.new_tensor(-math.inf))
        low = max(0.0, min(standard_low, float(below_min)))
        return low, 0.0, fp8_alpha_standard, CalibStatus.ALPHA_ZERO
    low = float(torch.kthvalue(fp8_negative, k).values)  # paper step 1: alpha_low quantile, k-th smallest
    return low, k / n_neg, fp8_alpha_standard, CalibStatus.OK


def _divide(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator != 0 else 0.0


def _upper_bound(
    ratio_ref: torch.Tensor,
    ratio_fp8: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    positive: torch.Tensor,
    n_pos: int,
    standard: ClipBounds,
    low: float,
    calibrate_high: bool,
    min_high: float,
) -> tuple[float, float, float, CalibStatus]:
    """(high, ref_p, achieved p, status): match p_FP8(low, high) to p_BF16(standard bounds)."""
    ref_pos, ref_neg = (float(c) for c in sign_contributions(ratio_ref, adv, mask, *standard))
    ref_p = _divide(ref_pos, ref_neg)
    fallback_high = max(standard.high, low)  # keeps low <= high even for absurd inputs
    fallback_pos, fp8_neg = (float(c) for c in sign_contributions(ratio_fp8, adv, mask, low, fallback_high))
    fallback_p = _divide(fallback_pos, fp8_neg)
    if not calibrate_high:
        return fallback_high, ref_p, fallback_p, CalibStatus.OK
    degenerate = {
        CalibStatus.NO_POS: n_pos == 0,
        CalibStatus.NO_REF_NEG_CONTRIB: ref_neg == 0.0,
        CalibStatus.NO_NEG_CONTRIB: fp8_neg == 0.0,
    }
    for flag, failed in degenerate.items():
        if failed:
            return fallback_high, ref_p, fallback_p, flag
    target = ref_p * fp8_neg  # paper step 2: contrib_pos_FP8 / contrib_neg_FP8 = p_BF16
    solution = solve_upper_bound(
        ratio_fp8[positive], adv[positive], target, preferred=standard.high, min_high=max(min_high, low)
    )
    status = CalibStatus.OK if solution.reachable else CalibStatus.P_UNREACHABLE
    return solution.high, ref_p, solution.contrib_pos / fp8_neg, status


class UpperBoundSolution(NamedTuple):
    """Result of :func:`solve_upper_bound`."""

    high: float
    contrib_pos: float  # sum of A r over the positive tokens with r < high
    reachable: bool  # whether the target lies within the reachable contributions


def solve_upper_bound(
    ratio_pos: torch.Tensor, adv_pos: torch.Tensor, target: float, preferred: float, min_high: float = 1.0
) -> UpperBoundSolution:
    """Exact step-function solve of contrib_pos(high) = sum_{r < high} A r closest to ``target``.

    Args:
        ratio_pos, adv_pos: (m,) FP8 ratios and advantages (> 0) of the positive masked tokens.
        target: the wanted positive contribution p_BF16 * contrib_neg_FP8.
        preferred: where ``high`` goes when several values are equally good (1 + eps_high).
        min_high: lower limit for ``high``.
    Returns:
        ``UpperBoundSolution(high, contrib_pos, reachable)``; ``high`` is a value of ratio_pos' dtype (so a
        token at a step is on the intended side), ``reachable`` says whether the target lies within
        [contrib(min_high), contrib(inf)].
    """
    weights_all = adv_pos * ratio_pos  # A r per token, as sign_contributions computes it
    always = ratio_pos < min_high  # below the floor: never clipped, a constant part of every C_j
    base = torch.where(always, weights_all, 0).sum(dtype=torch.float64).reshape(1)
    ordered, order = torch.sort(ratio_pos[~always])
    weights = weights_all[~always][order].to(torch.float64)
    cumulative = torch.cat([base, base + weights.cumsum(0)])  # C_j: the floor part and sorted tokens 1..j
    inf, minus_inf = ordered.new_full((1,), math.inf), ordered.new_full((1,), -math.inf)
    # Step j is reached for high in (s_j, s_{j+1}] (s_0 = -inf, s_{m+1} = +inf), intersected with [min_high, inf).
    interval_low = torch.cat([minus_inf, torch.nextafter(ordered, inf.expand_as(ordered))])
    interval_high = torch.cat([ordered, inf])
    interval_low = interval_low.clamp(min=ordered.new_tensor(min_high))
    achievable = interval_low <= interval_high
    candidate_high = torch.minimum(torch.maximum(ordered.new_tensor(preferred), interval_low), interval_high)

    error = (cumulative - target).abs()
    error = torch.where(achievable, error, math.inf)
    best = torch.nonzero(error == error.min()).flatten()  # all steps equally close to the target
    distance = (candidate_high[best].to(torch.float64) - preferred).abs()
    chosen = int(best[torch.argmin(distance)])
    reachable_values = cumulative[achievable]
    reachable = bool(reachable_values.min() <= target <= reachable_values.max())
    return UpperBoundSolution(float(candidate_high[chosen]), float(cumulative[chosen]), reachable)


# ---------------------------------------------------------------------------------------------------------
# Stateful clip-bound policies (registry): what the trainer holds between steps.


class ClipBoundPolicy(Protocol):
    """Interface of a clip-bound policy; see :class:`StandardClipBounds` / :class:`CalibratedClipBounds`."""

    calibrates: bool  # whether it calibrates on the BF16 shadow (else its bounds are fixed)

    @classmethod
    def config_errors(cls, algo: Any, clipping: Any, precision: Any) -> list[str]:
        """What a run's sections must change for this policy, in words (empty: nothing)."""
        ...

    @property
    def bounds(self) -> ClipBounds: ...

    def needs_calibration(self, step: int) -> bool: ...

    def wants_shadow(self, step: int) -> bool: ...

    def observe(
        self, ratio_ref: torch.Tensor, ratio_fp8: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> None: ...

    def update(
        self, ratio_ref: torch.Tensor, ratio_fp8: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, step: int
    ) -> ClipBounds: ...

    def metrics(self) -> Metrics: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


CLIP_BOUND_POLICIES: Registry[type] = Registry("clip-bound policy")
BOUND_KEYS = ("clip/bound_low", "clip/bound_high")


def get_clip_bound_policy(name: str) -> type:
    """The clip-bound policy class registered as ``name``."""
    return CLIP_BOUND_POLICIES.get(name)


def make_clip_bound_policy(name: str, **config: Any) -> ClipBoundPolicy:
    """Instantiate the clip-bound policy ``name`` with its config (eps_low, eps_high, ...)."""
    return get_clip_bound_policy(name)(**config)


@CLIP_BOUND_POLICIES.register("standard")
@dataclass
class StandardClipBounds:
    """Fixed PPO bounds [1 - eps_low, 1 + eps_high]; never asks for a calibration."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    calibrates: ClassVar[bool] = False

    @classmethod
    def from_config(cls, algo: Any, clipping: Any) -> StandardClipBounds:
        """From a run's ``algo`` and ``clipping`` sections (``fp8rl.config``)."""
        return cls(eps_low=algo.eps_low, eps_high=algo.eps_high)

    @classmethod
    def config_errors(cls, algo: Any, clipping: Any, precision: Any) -> list[str]:
        return []

    @property
    def bounds(self) -> ClipBounds:
        return standard_bounds(self.eps_low, self.eps_high)

    def needs_calibration(self, step: int) -> bool:
        return False

    def wants_shadow(self, step: int) -> bool:
        return False

    def observe(self, ratio_ref: torch.Tensor, ratio_fp8: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> None:
        pass

    def update(
        self, ratio_ref: torch.Tensor, ratio_fp8: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, step: int
    ) -> ClipBounds:
        return self.bounds

    def metrics(self) -> Metrics:
        return _as_metrics(dict(zip(BOUND_KEYS, self.bounds, strict=True)))

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


@CLIP_BOUND_POLICIES.register("calibrated")
@dataclass
class CalibratedClipBounds:
    """Calibrated Clipping held between recalibrations every ``interval`` steps and smoothed by an EMA.

    Usage per shadow step: ``policy.update(ratio_ref, ratio_fp8, adv, mask, step)`` when
    ``policy.needs_calibration(step)``, else ``policy.observe(ratio_ref, ratio_fp8, adv, mask)``; then
    ``clip_low, clip_high = policy.bounds``. ``policy.wants_shadow(step)`` says on which steps it needs the tokens.

    The calibration pool (project choice, ``pool_neg_tokens``): a calibration uses its own step's tokens and,
    when they hold fewer than ``pool_neg_tokens`` negative-advantage tokens, those of the newest earlier shadow
    steps until the pool holds that many. BF16 clips a few tenths of a percent of the negative tokens, so a
    pool of a few dozen tokens (one small step) sees none clipped and the quantile rule cannot act
    (CalibStatus.ALPHA_ZERO); at the paper's batch sizes one step holds thousands and the pool is that step.
    While a step alone does not fill the pool, ``wants_shadow`` asks for the shadow on every step.
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    interval: int = 20  # K: steps between calibrations (the paper's default)
    first_step: int | None = None  # step (0 = the first) of the first calibration; None = interval
    initial_bounds: tuple[float, float] | None = None  # None = the standard bounds
    ema: float = 0.5  # weight of the previous bound; 0 = jump to the calibrated value
    lower_bound_only: bool = False  # ablation: calibrate low, keep high = initial high
    min_high: float = 1.0
    pool_neg_tokens: int = 0  # 0 = the calibration step's tokens only
    _low: float = field(init=False, repr=False)
    _high: float = field(init=False, repr=False)
    _next_step: int = field(init=False, repr=False)
    _last: dict[str, float] = field(init=False, repr=False)
    _window: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(init=False, repr=False)
    calibrates: ClassVar[bool] = True

    @classmethod
    def config_errors(cls, algo: Any, clipping: Any, precision: Any) -> list[str]:
        """It compares FP8 trainer ratios with the BF16 shadow's after an update."""
        errors = []
        if precision.mode != "fp8_full":
            errors.append(
                "clipping.policy=calibrated aligns FP8 trainer ratios with BF16 ones: it needs precision.mode=fp8_full"
            )
        if algo.num_minibatches * algo.ppo_epochs < 2:
            errors.append(
                "clipping.policy=calibrated compares ratios after an update: set algo.num_minibatches >= 2 "
                "or algo.ppo_epochs >= 2"
            )
        return errors

    @classmethod
    def from_config(cls, algo: Any, clipping: Any) -> CalibratedClipBounds:
        """From a run's ``algo`` and ``clipping`` sections (``fp8rl.config``): the initial bounds default to the
        standard ones."""
        low, high = standard_bounds(algo.eps_low, algo.eps_high)
        return cls(
            eps_low=algo.eps_low,
            eps_high=algo.eps_high,
            interval=clipping.interval,
            first_step=clipping.first_step,
            initial_bounds=(
                clipping.init_low if clipping.init_low is not None else low,
                clipping.init_high if clipping.init_high is not None else high,
            ),
            ema=clipping.ema,
            lower_bound_only=clipping.lower_only,
            pool_neg_tokens=clipping.pool_neg_tokens,
        )

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ValueError(f"interval must be >= 1, got {self.interval}")
        if not 0.0 <= self.ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {self.ema}")
        if self.first_step is not None and self.first_step < 0:
            raise ValueError(f"first_step must be >= 0 (0 = the first step) or None, got {self.first_step}")
        if self.pool_neg_tokens < 0:
            raise ValueError(f"pool_neg_tokens must be >= 0, got {self.pool_neg_tokens}")
        initial = self.initial_bounds or standard_bounds(self.eps_low, self.eps_high)
        low, high = initial
        if not 0.0 <= low <= high:
            raise ValueError(f"initial_bounds must satisfy 0 <= low <= high, got {self.initial_bounds}")
        self._low, self._high = float(low), float(high)
        self._next_step = self.interval if self.first_step is None else self.first_step
        keys = ("status", "alpha_low", "ref_p", "p", "fp8_low_neg_standard", "count", "pool_neg", "pool_steps")
        self._last = dict.fromkeys(keys, 0.0)
        self._last.update(raw_low=self._low, raw_high=self._high)
        self._window = []

    @property
    def bounds(self) -> ClipBounds:
        return ClipBounds(self._low, self._high)

    def needs_calibration(self, step: int) -> bool:
        """True when ``step`` is at or past the next scheduled calibration."""
        return step >= self._next_step

    def wants_shadow(self, step: int) -> bool:
        """Calibration steps, and every step while one step's tokens do not fill the pool (class docstring)."""
        return self.needs_calibration(step) or _negatives(self._window[-1:]) < self.pool_neg_tokens

    def observe(self, ratio_ref: torch.Tensor, ratio_fp8: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> None:
        """Add a shadow step's masked tokens to the pool; drop the oldest steps the pool no longer needs."""
        selected = as_bool_mask(mask)
        token_adv = expand_adv(adv, ratio_fp8).detach()
        step_tokens = tuple(at_least_float32(t.detach()[selected]).cpu() for t in (ratio_ref, ratio_fp8, token_adv))
        self._window.append(step_tokens)
        while len(self._window) > 1 and _negatives(self._window[1:]) >= self.pool_neg_tokens:
            self._window.pop(0)

    def update(
        self, ratio_ref: torch.Tensor, ratio_fp8: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, step: int
    ) -> ClipBounds:
        """Pool this step's tokens, calibrate on the pool, smooth into the held bounds, schedule the next one."""
        self.observe(ratio_ref, ratio_fp8, adv, mask)
        pooled_ref, pooled_fp8, pooled_adv = (torch.cat(parts) for parts in zip(*self._window, strict=True))
        everything = torch.ones(1, pooled_adv.numel(), dtype=torch.bool)
        options = {"calibrate_high": not self.lower_bound_only, "min_high": self.min_high}
        result = calibrate(
            pooled_ref[None], pooled_fp8[None], pooled_adv[None], everything, self.eps_low, self.eps_high, **options
        )
        low = self.ema * self._low + (1.0 - self.ema) * result.bounds.low  # project choice: EMA smoothing
        high = self._high
        if not self.lower_bound_only:
            high = self.ema * self._high + (1.0 - self.ema) * result.bounds.high
        self._low, self._high = low, max(high, low)
        self._next_step = step + self.interval
        pool = {"pool_neg": float(result.n_neg), "pool_steps": float(len(self._window))}
        self._last = {**result.summary(), "count": self._last["count"] + 1.0, **pool}
        return self.bounds

    def metrics(self) -> Metrics:
        """``clip/bound_low``, ``clip/bound_high`` and the last calibration's ``clip/calib_*``."""
        metrics = {"clip/bound_low": self._low, "clip/bound_high": self._high}
        metrics.update({f"clip/calib_{key}": value for key, value in self._last.items()})
        return _as_metrics(metrics)

    def state_dict(self) -> dict[str, Any]:
        return {
            "low": self._low,
            "high": self._high,
            "next_step": self._next_step,
            "last": dict(self._last),
            "window": [[t.tolist() for t in step] for step in self._window],  # plain lists (float32 values exact)
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = {"low", "high", "next_step", "last"} - set(state)
        if missing:
            raise KeyError(f"clip-bound state is missing {sorted(missing)}")
        self._low, self._high = float(state["low"]), float(state["high"])
        self._next_step = int(state["next_step"])
        self._last.update({key: float(value) for key, value in state["last"].items()})
        # checkpoints written before the pool existed hold none: an empty pool, as at the start
        self._window = [
            tuple(torch.tensor(values, dtype=torch.float32) for values in step) for step in state.get("window", [])
        ]


def _negatives(window: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> int:
    """Negative-advantage tokens in a list of pooled steps (ratio_ref, ratio_fp8, adv)."""
    return sum(int((adv < 0).sum()) for _, _, adv in window)
