"""The BF16 shadow of an FP8 step: what BF16 would clip, measured on the same tokens.

On a shadow step (a calibration step, or every ``trainer.shadow_every`` steps) the trainer computes BF16
log-probs of pi_old once for the whole batch, and of pi_theta for every mini-batch after the first update
(before it, pi_theta = pi_old). Each such mini-batch's masked tokens (BF16 ratio, FP8 ratio, advantage) go
into one pool; at the end of the step the pool is gathered over all data-parallel ranks and

- Calibrated Clipping calibrates once on the whole pool (with the newest earlier shadow steps when the step
  alone holds fewer than ``clipping.pool_neg_tokens`` negative tokens); its new bounds apply from the next step;
- the over-clip rates are measured OUT OF SAMPLE. A Calibrated Clipping run measures the bounds in force this
  step (calibrated on earlier steps only) on this step's tokens (``clip/cc_oos_*``). Any other FP8 run asks
  what Calibrated Clipping would do from this step alone: the pool's sequences are split in two halves (by the
  parity of a key computed from each sequence's tokens, so every layout splits alike), bounds are calibrated
  on one half and the rates measured on the other (and the other way round; the two are averaged). The
  standard bounds the vanilla FP8 run uses are measured on the whole pool (``clip/shadow_*``);
- the spread of the BF16 log-ratio (``clip/shadow_ref_log_ratio_std``: the size of the real update) and of
  the FP8 log-ratio's deviation from it (``clip/shadow_fp8_noise_std``: FP8's noise floor) are logged, the
  collapse study's noise-to-signal criterion for its learning rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fp8rl import algos
from fp8rl.algos.calibration import CalibStatus
from fp8rl.algos.diagnostics import LOG_RATIO_CLAMP
from fp8rl.config import AlgoConfig
from fp8rl.models.dims import ParallelDims
from fp8rl.rollout.base import RolloutBatch

# (batch, recipe) -> (log-probs, entropy) of the batch's responses; recipe None = BF16
LogProbs = Callable[[RolloutBatch, Any], tuple[torch.Tensor, torch.Tensor]]

HISTOGRAM_EDGES = (0.5, 1.5, 100)  # ratio range and bins of the logged histograms


@dataclass
class _Pool:
    ratio_ref: list[torch.Tensor] = field(default_factory=list)  # (tokens,) per pooled sequence
    ratio_fp8: list[torch.Tensor] = field(default_factory=list)
    adv: list[torch.Tensor] = field(default_factory=list)
    half: list[int] = field(default_factory=list)  # 0 / 1 per pooled sequence: the out-of-sample split


class ShadowComparison:
    """Collects the BF16-vs-FP8 ratios of one step (module docstring)."""

    def __init__(self, logprobs: LogProbs, algo: AlgoConfig, dims: ParallelDims) -> None:
        self.logprobs, self.algo, self.dims = logprobs, algo, dims
        self.seconds = 0.0
        self._old_ref: torch.Tensor | None = None
        self._pool = _Pool()

    def record_old(self, batch: RolloutBatch) -> None:
        """BF16 log-probs of pi_old for every row of the step."""
        started = time.perf_counter()
        self._old_ref, _ = self.logprobs(batch, None)
        self.seconds += time.perf_counter() - started

    def bf16_ratio(self, mb: RolloutBatch, rows: torch.Tensor) -> torch.Tensor:
        """The BF16 ratio pi_theta / pi_old (rows, response_len) of a post-update mini-batch."""
        started = time.perf_counter()
        ref_logp, _ = self.logprobs(mb, None)
        self.seconds += time.perf_counter() - started
        return torch.exp(ref_logp - self._old_ref[rows])

    def add(
        self,
        ratio_ref: torch.Tensor,
        ratio_fp8: torch.Tensor,
        adv: torch.Tensor,
        mask: torch.Tensor,
        keys: torch.Tensor,
    ) -> None:
        """Pool a mini-batch's masked tokens, sequence by sequence: BF16 and FP8 ratios (rows, response_len),
        advantages (rows,), and each sequence's key (rows,): a number fixed by the sequence itself, not by its
        rank or position, whose parity puts it in one half of the out-of-sample split (`sequence_keys`)."""
        selected = mask.bool()
        token_adv = algos.broadcast_to_tokens(adv, mask)
        for row in range(selected.shape[0]):
            keep = selected[row]
            self._pool.ratio_ref.append(ratio_ref[row][keep].float().cpu())
            self._pool.ratio_fp8.append(ratio_fp8[row][keep].float().cpu())
            self._pool.adv.append(token_adv[row][keep].float().cpu())
            self._pool.half.append(int(keys[row]) % 2)

    @property
    def has_tokens(self) -> bool:
        return bool(self._pool.adv) and sum(t.numel() for t in self._pool.adv) > 0

    def pooled(self, half: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ratio_ref, ratio_fp8, adv) of the pooled tokens (of one half of the sequences), over all ranks."""
        dims = self.dims
        chosen = [i for i, h in enumerate(self._pool.half) if half is None or h == half]

        def cat(items: list[torch.Tensor]) -> torch.Tensor:
            local = torch.cat([items[i] for i in chosen]) if chosen else torch.zeros(0)
            return dims.gather_1d(local)

        return cat(self._pool.ratio_ref), cat(self._pool.ratio_fp8), cat(self._pool.adv)

    @staticmethod
    def overclip(
        ratio_ref: torch.Tensor,
        logp: torch.Tensor,
        tokens: algos.TokenBatch,
        bounds: tuple[float, float],
        algo: AlgoConfig,
        junk: torch.Tensor | None = None,
        groups: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """The update's over-clip metrics (``clip/overclip_neg``, ...): FP8's ratio of this update's log-probs
        `logp` at the bounds in force against the BF16 shadow's `ratio_ref` at the standard bounds, over the
        loss's tokens (after the rollout correction's rejection); with `junk` (bool, the task's junk tokens) the
        same within the junk tokens (``clip/overclip_neg_junk``, ...: FP8's dose on them); with `groups` (bool
        masks: token classes, p_old buckets) the token counts of FP8's clipping error per group at both bounds
        (``clip/count/...``, `algos.overclip_breakdown_counts`)."""
        mask = tokens.mask.bool()
        log_ratio = torch.where(mask, logp.float() - tokens.old_logp.float(), 0)
        ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # as the loss computes it
        reference = algos.standard_bounds(algo.eps_low, algo.eps_high)
        measured = algos.overclip_metrics(
            ratio_ref, ratio, tokens.adv.detach(), tokens.loss_mask, *bounds, *reference, with_fp8_contributions=False
        )
        if junk is not None:
            adv, mask = tokens.adv.detach(), tokens.loss_mask
            measured.update(
                algos.class_overclip_metrics(ratio_ref, ratio, adv, mask, bounds[0], reference[0], junk, "junk")
            )
        if groups:
            adv, mask = tokens.adv.detach(), tokens.loss_mask
            measured.update(algos.overclip_breakdown_counts(ratio_ref, ratio, adv, mask, bounds, reference, groups))
        return algos.metrics_to_floats(measured)

    def finish(self, step: int, clip_policy: algos.ClipBoundPolicy) -> dict[str, float]:
        """Calibrate on the pool (when due), and the pool's out-of-sample over-clip metrics."""
        a = self.algo
        calibrate = clip_policy.calibrates
        ratio_ref, ratio_fp8, adv = self.pooled()
        metrics = {"clip/shadow_tokens": float(adv.numel()), "clip/shadow_neg_tokens": float((adv < 0).sum())}
        if adv.numel() == 0:
            return metrics
        metrics.update(_standard_shadow_metrics(ratio_ref, ratio_fp8, adv, a.eps_low, a.eps_high))
        if calibrate:
            # the bounds in force were calibrated on earlier steps only: this step's tokens are out of sample
            metrics.update(_cc_metrics(ratio_ref, ratio_fp8, adv, clip_policy.bounds, a.eps_low, a.eps_high))
            ones = torch.ones(1, adv.numel(), dtype=torch.bool)
            if clip_policy.needs_calibration(step):
                clip_policy.update(ratio_ref[None], ratio_fp8[None], adv[None], ones, step)
                metrics.update(status_counts(clip_policy))
            else:
                clip_policy.observe(ratio_ref[None], ratio_fp8[None], adv[None], ones)
        else:
            metrics.update(self._out_of_sample(a.eps_low, a.eps_high, calibrate_high=not _lower_only(clip_policy)))
        return metrics

    def _out_of_sample(self, eps_low: float, eps_high: float, calibrate_high: bool) -> dict[str, float]:
        """Calibrate on one half of the pooled sequences and measure on the other, and the reverse; mean of the
        two (whole sequences, so one post-update mini-batch suffices; the halves do not depend on the layout)."""
        halves = [self.pooled(0), self.pooled(1)]
        if any(half[2].numel() == 0 for half in halves):
            return {}
        results: list[dict[str, float]] = []
        for fit, held_out in ((halves[0], halves[1]), (halves[1], halves[0])):
            fit_mask = torch.ones(1, fit[2].numel(), dtype=torch.bool)
            bounds = algos.calibrate(
                *(t[None] for t in fit), fit_mask, eps_low, eps_high, calibrate_high=calibrate_high
            )
            results.append(_cc_metrics(*held_out, bounds.bounds, eps_low, eps_high))
        return {k: (results[0][k] + results[1][k]) / 2 for k in results[0]}


def _cc_metrics(
    ratio_ref: torch.Tensor, ratio_fp8: torch.Tensor, adv: torch.Tensor, bounds: Any, eps_low: float, eps_high: float
) -> dict[str, float]:
    """``clip/cc_oos_*``: over-, under- and clipped shares of the pooled negative tokens at Calibrated Clipping's
    ``bounds`` (low, high), against BF16 at the standard bounds; the caller keeps the tokens out of sample."""
    low, high = bounds
    std_low, std_high = algos.standard_bounds(eps_low, eps_high)
    mask = torch.ones(1, adv.numel(), dtype=torch.bool)
    measured = algos.overclip_metrics(ratio_ref[None], ratio_fp8[None], adv[None], mask, low, high, std_low, std_high)
    clipped = algos.clip_fraction_metrics(ratio_fp8[None], adv[None], mask, low, high)
    return {
        "clip/cc_oos_overclip_neg": float(measured["clip/overclip_neg"]),
        "clip/cc_oos_underclip_neg": float(measured["clip/underclip_neg"]),
        "clip/cc_oos_low_neg": float(clipped["clip/low_neg"]),
        "clip/cc_oos_ref_low_neg": float(measured["clip/ref_low_neg"]),
    }


def _lower_only(clip_policy: Any) -> bool:
    return bool(getattr(clip_policy, "lower_bound_only", False))


def _standard_shadow_metrics(
    ratio_ref: torch.Tensor, ratio_fp8: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float
) -> dict[str, float]:
    """Over- and under-clipping of FP8 at the standard bounds against BF16 at the same bounds (the vanilla
    FP8 run's clipping error), on the whole pool."""
    low, high = algos.standard_bounds(eps_low, eps_high)
    mask = torch.ones(1, adv.numel(), dtype=torch.bool)
    measured = algos.overclip_metrics(ratio_ref[None], ratio_fp8[None], adv[None], mask, low, high, low, high)
    fp8_clipped = algos.clip_fraction_metrics(ratio_fp8[None], adv[None], mask, low, high)
    log_ref, log_fp8 = torch.log(ratio_ref.double()), torch.log(ratio_fp8.double())
    return {
        "clip/shadow_ref_log_ratio_std": _std(log_ref),  # the true update's size (signal)
        "clip/shadow_fp8_noise_std": _std(log_fp8 - log_ref),  # FP8's log-ratio noise floor
        "clip/shadow_overclip_neg": float(measured["clip/overclip_neg"]),
        "clip/shadow_underclip_neg": float(measured["clip/underclip_neg"]),
        "clip/shadow_ref_low_neg": float(measured["clip/ref_low_neg"]),
        "clip/shadow_fp8_low_neg": float(fp8_clipped["clip/low_neg"]),
    }


def _std(values: torch.Tensor) -> float:
    return float(values.std()) if values.numel() > 1 else 0.0


def status_counts(clip_policy: Any) -> dict[str, float]:
    """The last calibration's status as named 0/1 metrics (``clip/calib_ok``, ``clip/calib_alpha_zero``, ...)."""
    raw = algos.metrics_to_floats(clip_policy.metrics()).get("clip/calib_status")
    if raw is None:
        return {}
    status = CalibStatus(int(raw))
    out = {"clip/calib_ok": float(status == CalibStatus.OK)}
    for flag in CalibStatus:
        if flag is not CalibStatus.OK:
            out[f"clip/calib_{flag.name.lower()}"] = float(bool(status & flag))
    return out


def ratio_histogram(step: int, ratio_ref: torch.Tensor, ratio_fp8: torch.Tensor, adv: torch.Tensor) -> dict[str, Any]:
    """Histograms of the pooled BF16-shadow and FP8 ratios, split by advantage sign (for a figure)."""
    low, high, bins = HISTOGRAM_EDGES
    hist: dict[str, Any] = {"step": step, "edges": torch.linspace(low, high, bins + 1).tolist()}
    for sign, selected in (("neg", adv < 0), ("pos", adv > 0)):
        for name, ratio in (("bf16", ratio_ref), ("fp8", ratio_fp8)):
            values = ratio[selected].float().clamp(low, high)
            hist[f"{name}_{sign}"] = torch.histc(values, bins=bins, min=low, max=high).tolist()
    return hist


def ratio_histogram_figure(hist: dict[str, Any]) -> Any:
    """A figure of `ratio_histogram`'s output: BF16 shadow (dashed) vs FP8 (solid), by advantage sign."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges = hist["edges"]
    centers = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:], strict=True)]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for sign, color, label in (("neg", "tab:red", "A < 0"), ("pos", "tab:blue", "A > 0")):
        ax.step(centers, hist[f"fp8_{sign}"], where="mid", color=color, label=f"FP8, {label}")
        ax.step(centers, hist[f"bf16_{sign}"], where="mid", color=color, linestyle="--", alpha=0.7,
                label=f"BF16 shadow, {label}")  # fmt: skip
    if any(count > 0 for key in ("fp8_neg", "fp8_pos", "bf16_neg", "bf16_pos") for count in hist[key]):
        ax.set_yscale("log")  # (a step whose pool is empty keeps a linear axis: log of nothing warns)
    ax.set_xlabel("importance ratio pi_theta / pi_old")
    ax.set_ylabel("tokens")
    ax.set_title(f"step {hist['step']}: ratios after an update (pooled shadow tokens)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def close_figure(figure: Any) -> None:
    import matplotlib.pyplot as plt

    plt.close(figure)


def sequence_keys(response_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(rows,) a number per sequence fixed by its own tokens (position-weighted sum of its response ids):
    the same sequence gets the same key on any rank, in any mini-batch."""
    positions = torch.arange(1, response_ids.shape[-1] + 1, device=response_ids.device)
    return ((response_ids.long() * mask.long()) * positions).sum(-1).cpu()
