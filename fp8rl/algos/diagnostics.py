"""Diagnostics of the clipped objective, of FP8 vs BF16 ratios and of the rollout/train mismatch.

All functions take (batch, response_len) tensors (``adv`` may be (batch,)), a response mask, and return
``Metrics``: a dict of namespaced 0-d detached tensors (see :func:`fp8rl.algos.metrics_to_floats`).

Denominators (project convention), over masked tokens only, with A the advantage and r the ratio:

- ``clip/low_neg``  = #{A < 0, r <= low}  / #{A < 0}: negative tokens whose gradient is zeroed
  (the over-clipping the paper is about);
- ``clip/high_pos`` = #{A > 0, r >= high} / #{A > 0}: positive tokens whose gradient is zeroed;
- ``clip/low_pos``  = #{A > 0, r <= low}  / #{A > 0} and ``clip/high_neg`` = #{A < 0, r >= high} / #{A < 0}:
  outside the trust region but still carrying gradient under PPO clip;
- ``clip/frac`` = (#low_neg + #high_pos) / #masked: the fraction of all masked tokens (A = 0 included)
  whose gradient the clip zeroes (verl's ``pg_clipfrac``, with inclusive bounds).

"Contribution" of a sign (the project's reading of the paper's update contribution, see
``calibration.py``): contrib_pos = sum_{A > 0, r < high} A r, contrib_neg = sum_{A < 0, r > low} |A| r,
i.e. |A| r summed over the tokens of that sign that carry gradient. ``clip/p`` = contrib_pos / contrib_neg
(0 when contrib_neg = 0); the contributions themselves are logged divided by #masked so they do not scale
with the batch size (``p`` is unaffected). Every quantity over an empty selection is 0 (quantiles: 1.0).
"""

from __future__ import annotations

import torch

from fp8rl.algos.masked import (
    Metrics,
    as_bool_mask,
    at_least_float32,
    expand_adv,
    masked_fraction,
    masked_mean,
    masked_quantiles,
    masked_sum,
    safe_div,
)

RATIO_QUANTILES = (0.01, 0.05, 0.5, 0.95, 0.99)
LOG_RATIO_CLAMP = 20.0  # |log ratio| beyond this is clamped before exp (verl clamps at 20 as well)


@torch.no_grad()
def clip_fraction_metrics(
    ratio: torch.Tensor, adv: torch.Tensor, response_mask: torch.Tensor, clip_low: float, clip_high: float
) -> Metrics:
    """Clip fractions split by bound and advantage sign (denominators in the module docstring)."""
    mask = as_bool_mask(response_mask)
    adv = expand_adv(adv, ratio)
    negative, positive = mask & (adv < 0), mask & (adv > 0)
    below, above = ratio <= clip_low, ratio >= clip_high
    zeroed = (negative & below) | (positive & above)
    return {
        "clip/low_neg": masked_fraction(below, negative),
        "clip/high_pos": masked_fraction(above, positive),
        "clip/low_pos": masked_fraction(below, positive),
        "clip/high_neg": masked_fraction(above, negative),
        "clip/frac": masked_fraction(zeroed, mask),
    }


def sign_contributions(
    ratio: torch.Tensor, adv: torch.Tensor, response_mask: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(contrib_pos, contrib_neg), 0-d float64: sum of |A| r over the tokens of each sign carrying gradient."""
    mask = as_bool_mask(response_mask)
    adv, ratio = expand_adv(adv, ratio).detach(), ratio.detach()
    # compare in the ratio's own dtype, as the loss does; accumulate in float64
    carries_pos = mask & (adv > 0) & (ratio < clip_high)  # A > 0 unclipped: r < high
    carries_neg = mask & (adv < 0) & (ratio > clip_low)  # A < 0 unclipped: r > low
    weighted = adv.abs() * ratio
    zero = weighted.new_zeros(())
    contrib_pos = torch.where(carries_pos, weighted, zero).sum(dtype=torch.float64)
    contrib_neg = torch.where(carries_neg, weighted, zero).sum(dtype=torch.float64)
    return contrib_pos, contrib_neg


@torch.no_grad()
def contribution_metrics(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    prefix: str = "clip/",
) -> Metrics:
    """``{prefix}contrib_pos``, ``{prefix}contrib_neg`` (per masked token) and ``{prefix}p`` = pos / neg."""
    contrib_pos, contrib_neg = sign_contributions(ratio, adv, response_mask, clip_low, clip_high)
    count = as_bool_mask(response_mask).sum().to(torch.float64)
    return {
        f"{prefix}contrib_pos": safe_div(contrib_pos, count).float(),
        f"{prefix}contrib_neg": safe_div(contrib_neg, count).float(),
        f"{prefix}p": safe_div(contrib_pos, contrib_neg).float(),
    }


@torch.no_grad()
def ratio_quantile_metrics(ratio: torch.Tensor, response_mask: torch.Tensor, prefix: str = "actor/ratio") -> Metrics:
    """``actor/ratio_q01 .. _q99`` and ``actor/ratio_mean`` over masked tokens (1.0 when all masked)."""
    mask = as_bool_mask(response_mask)
    values = masked_quantiles(ratio, mask, RATIO_QUANTILES)
    metrics = {f"{prefix}_q{round(q * 100):02d}": values[i] for i, q in enumerate(RATIO_QUANTILES)}
    metrics[f"{prefix}_mean"] = masked_mean(ratio.detach(), mask)
    return metrics


@torch.no_grad()
def class_overclip_metrics(
    ratio_ref: torch.Tensor,
    ratio: torch.Tensor,
    adv: torch.Tensor,
    response_mask: torch.Tensor,
    low: float,
    ref_low: float,
    in_class: torch.Tensor,
    name: str,
) -> Metrics:
    """`overclip_metrics`' lower-bound pair within one token class (``in_class``, bool), as FP8's dose on it:
    ``clip/overclip_neg_<name>`` (clipped in FP8, not in BF16) and ``clip/underclip_neg_<name>`` (the reverse),
    each / #{A < 0 tokens of the class}; ``clip/neg_share_<name>``: the class's share of the A < 0 tokens."""
    mask = as_bool_mask(response_mask)
    negative = mask & (expand_adv(adv, ratio) < 0)
    fp8_low, ref_low_hit = ratio <= low, ratio_ref <= ref_low
    of_class = negative & in_class
    return {
        f"clip/overclip_neg_{name}": masked_fraction(fp8_low & ~ref_low_hit, of_class),
        f"clip/underclip_neg_{name}": masked_fraction(~fp8_low & ref_low_hit, of_class),
        f"clip/neg_share_{name}": masked_fraction(in_class, negative),
    }


P_OLD_BUCKETS = (0.01, 0.1, 0.5)  # edges of the p_old buckets of `overclip_breakdown_counts`: [0, .01), ..., [.5, 1]


def p_old_groups(old_logp: torch.Tensor, edges: tuple[float, ...] = P_OLD_BUCKETS) -> dict[str, torch.Tensor]:
    """Bool masks of the tokens by the old policy's probability exp(old_logp), one per bucket between `edges`
    (and 0 and 1), named by their range in percent: ``pold_0_1``, ``pold_1_10``, ``pold_10_50``, ``pold_50_100``."""
    prob = torch.exp(old_logp.float())
    bounds = (0.0, *edges, float("inf"))
    pairs = zip(bounds, bounds[1:], strict=False)
    names = p_old_bucket_names(edges)
    return {name: (prob >= low) & (prob < high) for name, (low, high) in zip(names, pairs, strict=True)}


def p_old_bucket_names(edges: tuple[float, ...] = P_OLD_BUCKETS) -> list[str]:
    """The names of `p_old_groups`' buckets, in order."""
    bounds = (0.0, *edges, 1.0)
    return [f"pold_{low * 100:g}_{high * 100:g}" for low, high in zip(bounds, bounds[1:], strict=False)]


def overclip_breakdown_counts(
    ratio_ref: torch.Tensor,
    ratio: torch.Tensor,
    adv: torch.Tensor,
    response_mask: torch.Tensor,
    bounds: tuple[float, float],
    ref_bounds: tuple[float, float],
    groups: dict[str, torch.Tensor],
) -> Metrics:
    """Token counts for FP8's clipping error by group (token classes, p_old buckets: bool masks in `groups`), at
    both bounds: per group g and sign s (``neg``: A < 0 at the lower bound, ``pos``: A > 0 at the upper),
    ``clip/count/<s>_<g>`` (the group's tokens of that sign), ``clip/count/overclip_<s>_<g>`` (clipped in FP8 at
    `bounds`, not in BF16 at `ref_bounds`) and ``clip/count/underclip_<s>_<g>`` (the reverse). Counts, not
    shares, so that shares pooled over updates, ranks and seeds are ratios of sums (a share per update weighs an
    update with one token of a group like one with a hundred)."""
    mask = as_bool_mask(response_mask)
    adv = expand_adv(adv, ratio)
    low, high = bounds
    ref_low, ref_high = ref_bounds
    sides = {
        "neg": (mask & (adv < 0), ratio <= low, ratio_ref <= ref_low),
        "pos": (mask & (adv > 0), ratio >= high, ratio_ref >= ref_high),
    }
    metrics: Metrics = {}
    for group, in_group in groups.items():
        for sign, (selected, fp8_hit, ref_hit) in sides.items():
            chosen = selected & in_group
            metrics[f"clip/count/{sign}_{group}"] = chosen.sum().float()
            metrics[f"clip/count/overclip_{sign}_{group}"] = (chosen & fp8_hit & ~ref_hit).sum().float()
            metrics[f"clip/count/underclip_{sign}_{group}"] = (chosen & ~fp8_hit & ref_hit).sum().float()
    return metrics


def overclip_metrics(
    ratio_ref: torch.Tensor,
    ratio: torch.Tensor,
    adv: torch.Tensor,
    response_mask: torch.Tensor,
    low: float,
    high: float,
    ref_low: float,
    ref_high: float,
    *,
    with_fp8_contributions: bool = True,
) -> Metrics:
    """FP8 clipping (``ratio`` with [low, high]) vs BF16 clipping (``ratio_ref`` with [ref_low, ref_high]).

    ``clip/overclip_neg``: negative tokens clipped in FP8 but not in BF16, / #{A < 0};
    ``clip/underclip_neg``: the reverse; ``clip/overclip_pos`` / ``clip/underclip_pos`` likewise at the upper
    bound, / #{A > 0}; ``clip/ref_low_neg``, ``clip/ref_high_pos``: BF16 clip fractions; contributions and
    p for both (``clip/contrib_*``, ``clip/p``, ``clip/ref_contrib_*``, ``clip/ref_p``);
    ``fp8/log_ratio_abs_diff``: mean |log ratio - log ratio_ref|. ``with_fp8_contributions=False`` skips
    ``clip/contrib_*`` and ``clip/p`` (the loss has computed them already).
    """
    mask = as_bool_mask(response_mask)
    adv = expand_adv(adv, ratio)
    negative, positive = mask & (adv < 0), mask & (adv > 0)
    fp8_low, ref_low_hit = ratio <= low, ratio_ref <= ref_low
    fp8_high, ref_high_hit = ratio >= high, ratio_ref >= ref_high
    log_diff = torch.log(at_least_float32(ratio) / at_least_float32(ratio_ref))
    metrics = {
        "clip/overclip_neg": masked_fraction(fp8_low & ~ref_low_hit, negative),
        "clip/underclip_neg": masked_fraction(~fp8_low & ref_low_hit, negative),
        "clip/overclip_pos": masked_fraction(fp8_high & ~ref_high_hit, positive),
        "clip/underclip_pos": masked_fraction(~fp8_high & ref_high_hit, positive),
        "clip/ref_low_neg": masked_fraction(ref_low_hit, negative),
        "clip/ref_high_pos": masked_fraction(ref_high_hit, positive),
        "fp8/log_ratio_abs_diff": masked_mean(log_diff.abs(), mask),
    }
    if with_fp8_contributions:
        metrics.update(contribution_metrics(ratio, adv, mask, low, high, prefix="clip/"))
    metrics.update(contribution_metrics(ratio_ref, adv, mask, ref_low, ref_high, prefix="clip/ref_"))
    return metrics


@torch.no_grad()
def clip_overlap_metrics(
    ratio_ref: torch.Tensor,
    ratio: torch.Tensor,
    adv: torch.Tensor,
    response_mask: torch.Tensor,
    low: float,
    ref_low: float,
    prefix: str = "clip/overlap_",
) -> Metrics:
    """Which negative-advantage tokens are clipped, not only how many: FP8 clipping (``ratio <= low``)
    against BF16 clipping (``ratio_ref <= ref_low``) as a retrieval of BF16's set.

    ``{prefix}precision`` = |FP8 ∩ BF16| / |FP8| (of the tokens FP8 clips, the share BF16 clips too),
    ``{prefix}recall`` = |FP8 ∩ BF16| / |BF16|; 1.0 when the divisor set is empty; plus the two counts.
    """
    mask = as_bool_mask(response_mask)
    negative = mask & (expand_adv(adv, ratio) < 0)
    fp8_set, ref_set = negative & (ratio <= low), negative & (ratio_ref <= ref_low)
    both = (fp8_set & ref_set).sum()
    n_fp8, n_ref = fp8_set.sum(), ref_set.sum()
    one = torch.ones((), dtype=torch.float32)
    return {
        f"{prefix}precision": (both / n_fp8).float() if n_fp8 else one,
        f"{prefix}recall": (both / n_ref).float() if n_ref else one,
        f"{prefix}n_fp8": n_fp8.float(),
        f"{prefix}n_ref": n_ref.float(),
    }


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy (batch, response_len) of softmax(logits), logits (batch, response_len, vocab)."""
    logits = at_least_float32(logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)  # H = log Z - sum_v p_v z_v


@torch.no_grad()
def entropy_metrics(entropy: torch.Tensor, response_mask: torch.Tensor) -> Metrics:
    """``actor/entropy``: mean per-token entropy over masked tokens; entropy (batch, response_len)."""
    return {"actor/entropy": masked_mean(entropy.detach(), as_bool_mask(response_mask))}


@torch.no_grad()
def rollout_mismatch_metrics(
    logp_train: torch.Tensor, logp_rollout: torch.Tensor, response_mask: torch.Tensor
) -> Metrics:
    """Train/rollout mismatch over masked tokens, log-probs (batch, response_len).

    ``rollout/abs_logp_diff``: mean |logp_train - logp_rollout|; ``rollout/max_abs_logp_diff``;
    ``rollout/token_mult_prob_error``: mean exp(|diff|) (NeMo-RL; > 1.05 signals trouble);
    ``rollout/k3_kl``: k3 estimate of KL(pi_rollout || pi_train) from the rollout's samples,
    mean of exp(d) - 1 - d with d = logp_train - logp_rollout. |d| is clamped at 20 before exp.
    """
    mask = as_bool_mask(response_mask)
    diff = torch.where(mask, at_least_float32(logp_train) - at_least_float32(logp_rollout), 0)
    diff = diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return {
        "rollout/abs_logp_diff": masked_mean(diff.abs(), mask),
        "rollout/max_abs_logp_diff": diff.abs().max() if diff.numel() else diff.new_zeros(()),
        "rollout/token_mult_prob_error": masked_mean(torch.exp(diff.abs()), mask),
        "rollout/k3_kl": masked_mean(torch.exp(diff) - 1 - diff, mask),  # k3 with r = pi_train / pi_rollout
    }


VERL_SAFETY_BOUND = 20.0  # verl's clamp of log ratios before exp in its chi-square metrics


@torch.no_grad()
def offpolicy_statistics(
    logp_train: torch.Tensor, logp_rollout: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """What `offpolicy_metrics` needs, in a form that data-parallel ranks combine: per-sequence vectors
    (concatenated over ranks) and token sums (summed over ranks). Log-probs (batch, response_len)."""
    mask = as_bool_mask(response_mask)
    train, rollout = at_least_float32(logp_train).double(), at_least_float32(logp_rollout).double()
    log_ratio = train - rollout
    count = mask.sum(-1).double()
    rho = torch.exp(log_ratio.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND))
    return {
        "seq_mean_logp_train": masked_sum(train, mask, -1) / (count + 1e-8),  # verl_F.masked_mean's divisor
        "seq_mean_logp_rollout": masked_sum(rollout, mask, -1) / (count + 1e-8),
        "seq_log_ratio_sum": masked_sum(log_ratio, mask, -1),
        "token_sums": torch.stack(
            [
                count.sum(),
                masked_sum(-log_ratio, mask),  # kl
                masked_sum(torch.exp(log_ratio) - log_ratio - 1, mask),  # k3 (unclamped, as verl)
                masked_sum(rho.square(), mask),  # chi2_token
            ]
        ),
    }


def offpolicy_metrics(stats: dict[str, torch.Tensor]) -> Metrics:
    """verl's rollout/train mismatch metrics (``rollout_corr/``: ``compute_offpolicy_metrics`` of
    verl/trainer/ppo/rollout_corr_helper.py): from `offpolicy_statistics`, whole batch (all ranks).

    kl = E_tok[log pi_rollout - log pi_train]; k3_kl = E_tok[r - log r - 1], r = pi_train / pi_rollout;
    training/rollout ppl = E_seq[exp(-mean log p)] (and log ppl); log_ppl_diff_i = mean log pi_rollout -
    mean log pi_train of sequence i (mean, mean |.|, max, min); ppl_ratio = E_seq[exp(log_ppl_diff_i)];
    chi2_token = E_tok[r^2] - 1; chi2_seq = E_seq[(prod_t r_t)^2] - 1 (log ratios clamped at +-20 there).
    """
    count, kl_sum, k3_sum, rho2_sum = stats["token_sums"].unbind()
    train, rollout = stats["seq_mean_logp_train"], stats["seq_mean_logp_rollout"]
    diff = rollout - train
    seq_sum = stats["seq_log_ratio_sum"].clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)
    return {
        "rollout_corr/kl": kl_sum / count,
        "rollout_corr/k3_kl": k3_sum / count,
        "rollout_corr/training_ppl": torch.exp(-train).mean(),
        "rollout_corr/training_log_ppl": (-train).mean(),
        "rollout_corr/rollout_ppl": torch.exp(-rollout).mean(),
        "rollout_corr/rollout_log_ppl": (-rollout).mean(),
        "rollout_corr/log_ppl_diff": diff.mean(),
        "rollout_corr/log_ppl_abs_diff": diff.abs().mean(),
        "rollout_corr/log_ppl_diff_max": diff.max(),
        "rollout_corr/log_ppl_diff_min": diff.min(),
        "rollout_corr/ppl_ratio": torch.exp(diff).mean(),
        "rollout_corr/chi2_token": rho2_sum / count - 1.0,
        "rollout_corr/chi2_seq": torch.exp(2.0 * seq_sum).mean() - 1.0,
    }


@torch.no_grad()
def synthetic_overclip_mask(
    log_ratio: torch.Tensor,
    adv: torch.Tensor,
    response_mask: torch.Tensor,
    noise: torch.Tensor,
    clip_low: float,
) -> torch.Tensor:
    """Negative-advantage tokens that noise of FP8's size would push out of the trust region (the positive
    control of the collapse study, issue 18): A < 0, log r > log(clip_low) (BF16 keeps their gradient) and
    log r + noise <= log(clip_low). All inputs (batch, response_len) (``adv`` may be (batch,)), ``noise`` drawn
    by the caller (e.g. N(0, sigma^2) with sigma the measured FP8 log-ratio noise). Returns a bool mask."""
    mask = as_bool_mask(response_mask)
    adv = expand_adv(adv, log_ratio)
    bound = torch.log(torch.tensor(float(clip_low), dtype=torch.float64)).item()
    log_ratio = at_least_float32(log_ratio.detach())
    return mask & (adv < 0) & (log_ratio > bound) & (log_ratio + noise.to(log_ratio.dtype) <= bound)


@torch.no_grad()
def synthetic_class_drop_mask(
    adv: torch.Tensor,
    response_mask: torch.Tensor,
    in_class: torch.Tensor,
    uniform: torch.Tensor,
    share: float,
    matched_other: bool = False,
) -> torch.Tensor:
    """Negative-advantage tokens whose gradient the junk organism's controls zero (results/studies/
    2026-12-06-junk-organism.md): each A < 0 token of the class (`in_class`, bool) with probability `share`
    (``uniform < share``); with `matched_other`, instead as many A < 0 tokens outside the class (all of them if
    fewer), those with the smallest draws: the same count, untargeted. All inputs (batch, response_len) (``adv``
    may be (batch,)), ``uniform`` U(0, 1) draws made by the caller. Returns a bool mask."""
    mask = as_bool_mask(response_mask)
    negative = mask & (expand_adv(adv, uniform) < 0)
    chosen = negative & in_class & (uniform < share)
    if not matched_other:
        return chosen
    others = negative & ~in_class
    count = min(int(chosen.sum()), int(others.sum()))
    out = torch.zeros_like(others)
    if count:
        keys = torch.where(others, uniform, torch.full_like(uniform, 2.0)).flatten()
        out.view(-1)[torch.topk(keys, count, largest=False).indices] = True
    return out
