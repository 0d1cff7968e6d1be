"""One entropy-surge detector for every run (pure python).

The paper's failure shows as a mid-training surge of the actor's entropy. For a run's per-step rollout
entropy h_1..h_T:

- smooth with a centred moving average of `window` steps (one noisy batch is not a surge);
- baseline b = median of the raw h over the first `baseline_frac` of the steps (at least 3 steps);
- surge ratio = max(smoothed h after the baseline window) / b;
- the run *surged* when the ratio is at least `ratio` and the rise max - b is at least `min_rise` nats.

Defaults (window 5, baseline 25% of the run, ratio 2.0, rise 0.05 nats) are ours; the paper gives no
numeric rule. A collapse of entropy (RL sharpening the policy) is not a surge.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SurgeRule:
    window: int = 5
    baseline_frac: float = 0.25
    ratio: float = 2.0
    min_rise: float = 0.05


@dataclass(frozen=True)
class Surge:
    baseline: float
    peak: float  # max of the smoothed entropy after the baseline window
    ratio: float  # peak / baseline
    surged: bool


def moving_average(values: Sequence[float], window: int) -> list[float]:
    half = window // 2
    return [statistics.fmean(values[max(0, i - half) : i + half + 1]) for i in range(len(values))]


def detect_surge(entropy: Sequence[float], rule: SurgeRule = SurgeRule()) -> Surge:
    """Apply `rule` to a run's per-step entropy (in step order)."""
    values = [float(v) for v in entropy]
    if len(values) < 4:
        raise ValueError(f"need at least 4 steps of entropy to detect a surge, got {len(values)}")
    n_base = max(3, int(len(values) * rule.baseline_frac))
    n_base = min(n_base, len(values) - 1)
    baseline = statistics.median(values[:n_base])
    peak = max(moving_average(values, rule.window)[n_base:])
    ratio = peak / baseline if baseline > 0 else float("inf")
    return Surge(baseline, peak, ratio, ratio >= rule.ratio and peak - baseline >= rule.min_rise)
