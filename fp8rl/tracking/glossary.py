"""What every logged metric means: one line per key (or key pattern), the one source of docs/metrics.md.

Keys are MLflow metric names as the trainer logs them. A pattern holds ``<placeholders>`` that each stand
for one name part without a slash: ``eval/<set>/avg_at_<k>`` covers ``eval/heldout/avg_at_1``. A test
trains a step of every kind of run and fails on a logged key with no line here; ``make docs`` writes the
glossary into docs/metrics.md (`fp8rl.docs`).

Conventions: "share" is a fraction in [0, 1]; ratios are pi_theta / pi_old per token; "negative tokens" are
the masked response tokens whose advantage A < 0; step metrics are means over the step's mini-batches.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import cache

CALIBRATION_RULES = {  # a calibration's outcome (CalibStatus, fp8rl.algos.calibration) -> what happened
    "ok": "both bounds were calibrated as the paper says (none of the cases below)",
    "empty": "no masked token: both bounds kept standard",
    "no_neg": "no negative token: low kept standard",
    "alpha_zero": "BF16 clipped no negative token: low is set just below FP8's smallest negative ratio, so FP8 "
    "clips none either",
    "no_pos": "no positive token: high kept standard",
    "no_ref_neg_contrib": "BF16's negative contribution was 0, so its p is undefined: high kept standard",
    "no_neg_contrib": "FP8's negative contribution was 0, so p is undefined: high kept standard",
    "p_unreachable": "no upper bound reaches BF16's p: the closest reachable high is used",
}

ROLLOUT = {
    "rollout/reward": "mean task reward of the step's rollouts (1 = correct answer), before any shaping",
    "rollout/shaped_reward": "mean reward after shaping (DAPO's overlong penalty); equals rollout/reward without it",
    "rollout/response_len": "mean response length (tokens)",
    "rollout/entropy": "rollout entropy: mean per-token entropy (nats) of the rollout engine's sampling "
    "distribution over response tokens (the paper's entropy curve)",
    "rollout/garbled_rate": "share of rollouts that are garbled (any of the reasons below)",
    "rollout/garbled_invalid_token": "share of rollouts with a token outside the answer grammar before <eos>",
    "rollout/garbled_no_eos": "share of rollouts with no <eos> within the response length limit",
    "rollout/garbled_unparseable": "share of rollouts with only grammar tokens but no readable answer",
    "rollout/junk_token_rate": "chain task: share of rollout response tokens that are junk letters (never right)",
    "rollout/junk_response_rate": "chain task: share of rollouts with at least one junk letter",
    "rollout/dropped_groups": "DAPO dynamic sampling: groups without reward variation dropped (all ranks)",
    "rollout/sampling_rounds": "DAPO dynamic sampling: rounds sampled this step to fill the batch",
    "rollout/kept_groups": "DAPO dynamic sampling: groups with reward variation collected (at most the batch)",
    "rollout/tis_mean": "mean truncated importance weight pi_old_train / pi_rollout over tokens (TIS)",
    "rollout/tis_max": "largest importance weight pi_old_train / pi_rollout before truncation",
    "rollout/tis_trunc_frac": "share of tokens whose importance weight was truncated at clipping.tis_cap",
    "rollout/mis_masked_frac": "share of tokens masked out of the loss by masked importance sampling (MIS)",
    "rollout/mis_seq_masked_frac": "share of sequences masked out by sequence-level MIS",
    "rollout/abs_logp_diff": "mean |log pi_train - log pi_rollout| over response tokens (rollout/train mismatch)",
    "rollout/max_abs_logp_diff": "largest |log pi_train - log pi_rollout| of the step",
    "rollout/token_mult_prob_error": "mean exp(|log pi_train - log pi_rollout|) (NeMo-RL; above 1.05 signals trouble)",
    "rollout/k3_kl": "k3 estimate of KL(pi_rollout || pi_train) from the rollout's samples",
    # verl's rollout_corr set (verl/trainer/ppo/rollout_corr_helper.py compute_offpolicy_metrics), whole batch,
    # old log-probs of the trainer against the rollout's; r = pi_train / pi_rollout per token
    "rollout_corr/kl": "verl: mean log pi_rollout - log pi_train over tokens (direct KL(pi_rollout || pi_train))",
    "rollout_corr/k3_kl": "verl: mean r - log r - 1 over tokens (k3 KL estimate, unclamped)",
    "rollout_corr/training_ppl": "verl: mean over sequences of exp(-mean log pi_train)",
    "rollout_corr/training_log_ppl": "verl: mean over sequences of -mean log pi_train",
    "rollout_corr/rollout_ppl": "verl: mean over sequences of exp(-mean log pi_rollout)",
    "rollout_corr/rollout_log_ppl": "verl: mean over sequences of -mean log pi_rollout",
    "rollout_corr/log_ppl_diff": "verl: mean over sequences of (mean log pi_rollout - mean log pi_train)",
    "rollout_corr/log_ppl_abs_diff": "verl: mean over sequences of |mean log pi_rollout - mean log pi_train|",
    "rollout_corr/log_ppl_diff_max": "verl: largest per-sequence log-perplexity difference",
    "rollout_corr/log_ppl_diff_min": "verl: smallest per-sequence log-perplexity difference",
    "rollout_corr/ppl_ratio": "verl: mean over sequences of training ppl / rollout ppl",
    "rollout_corr/chi2_token": "verl: mean r^2 - 1 over tokens (chi-square divergence, log r clamped at +-20)",
    "rollout_corr/chi2_seq": "verl: mean over sequences of (prod r)^2 - 1 (sum of log r clamped at +-20)",
}

ACTOR = {
    "actor/loss": "the loss minimised: policy loss + KL penalty - entropy bonus (sum over the step's shares)",
    "actor/pg_loss": "policy-gradient (clipped surrogate) loss",
    "actor/kl_loss": "KL penalty to the reference policy, before algo.kl_coef",
    "actor/entropy": "mean per-token entropy (nats) of the trainer's forward, in the training precision",
    "actor/ppo_kl": "k1 estimate of KL(pi_old || pi_theta) over response tokens",
    "actor/grad_norm": "gradient norm before clipping at algo.grad_clip",
    "actor/ratio_mean": "mean importance ratio pi_theta / pi_old over response tokens",
    "actor/ratio_q<nn>": "the nn-th percentile (01, 05, 50, 95, 99) of the importance ratio over response tokens",
}

CLIP = {
    "clip/bound_low": "lower clip bound in force (ratio space; 0.8 standard, moved by Calibrated Clipping)",
    "clip/bound_high": "upper clip bound in force (ratio space; 1.2 standard, moved by Calibrated Clipping)",
    "clip/low_neg": "share of negative tokens whose gradient the clip zeroes (r <= low): the over-clipping the "
    "paper is about",
    "clip/high_pos": "share of positive tokens whose gradient the clip zeroes (r >= high)",
    "clip/low_pos": "share of positive tokens below the low bound (still carry gradient under PPO clip)",
    "clip/high_neg": "share of negative tokens above the high bound (still carry gradient under PPO clip)",
    "clip/frac": "share of all response tokens whose gradient the clip zeroes (verl's pg_clipfrac)",
    "clip/contrib_pos": "sum of A r over positive tokens that carry gradient, per response token",
    "clip/contrib_neg": "sum of |A| r over negative tokens that carry gradient, per response token",
    "clip/p": "p = contrib_pos / contrib_neg: the balance of positive and negative updates",
    "clip/dual_neg": "share of negative tokens bounded by dual-clip's constant c",
    "clip/ref_low_neg": "BF16 shadow: share of negative tokens BF16 clips at the standard low bound",
    "clip/ref_high_pos": "BF16 shadow: share of positive tokens BF16 clips at the standard high bound",
    "clip/ref_contrib_pos": "BF16 shadow: clip/contrib_pos of the BF16 ratios at the standard bounds",
    "clip/ref_contrib_neg": "BF16 shadow: clip/contrib_neg of the BF16 ratios at the standard bounds",
    "clip/ref_p": "BF16 shadow: p of the BF16 ratios at the standard bounds (what Calibrated Clipping matches)",
    "clip/overclip_neg": "shadow step: share of negative tokens FP8 clips and BF16 would not",
    "clip/underclip_neg": "shadow step: share of negative tokens BF16 clips and FP8 does not",
    "clip/overclip_pos": "shadow step: share of positive tokens FP8 clips and BF16 would not",
    "clip/underclip_pos": "shadow step: share of positive tokens BF16 clips and FP8 does not",
    "clip/overlap_precision": "shadow step: of the negative tokens FP8 clips, the share BF16 clips too",
    "clip/overlap_recall": "shadow step: of the negative tokens BF16 clips, the share FP8 clips too",
    "clip/overlap_n_fp8": "shadow step: negative tokens FP8 clips",
    "clip/overlap_n_ref": "shadow step: negative tokens BF16 clips",
    "clip/shadow_tokens": "shadow step: tokens pooled for the BF16-vs-FP8 comparison",
    "clip/shadow_neg_tokens": "shadow step: negative tokens in the pool",
    "clip/shadow_overclip_neg": "shadow step, standard bounds: share of pooled negative tokens FP8 clips and BF16 "
    "would not (the vanilla FP8 run's over-clipping)",
    "clip/shadow_underclip_neg": "shadow step, standard bounds: share of pooled negative tokens BF16 clips and FP8 "
    "does not",
    "clip/shadow_ref_log_ratio_std": "shadow step: standard deviation of BF16's log-ratio over the pooled tokens "
    "(the size of the real update: the signal)",
    "clip/shadow_fp8_noise_std": "shadow step: standard deviation of log r_FP8 - log r_BF16 over the pooled tokens "
    "(FP8's noise floor)",
    "clip/shadow_ref_low_neg": "shadow step: share of pooled negative tokens BF16 clips at the standard low bound",
    "clip/shadow_fp8_low_neg": "shadow step: share of pooled negative tokens FP8 clips at the standard low bound",
    "clip/cc_oos_overclip_neg": "shadow step, out of sample: over-clipping of negative tokens with Calibrated "
    "Clipping's bounds: in a CC run the bounds in force (calibrated on earlier steps), in another FP8 run bounds "
    "calibrated on the other half of this step's pool",
    "clip/cc_oos_underclip_neg": "shadow step, out of sample: under-clipping of negative tokens with calibrated bounds",
    "clip/cc_oos_low_neg": "shadow step, out of sample: share of negative tokens FP8 clips at calibrated bounds",
    "clip/cc_oos_ref_low_neg": "shadow step, out of sample: share of negative tokens BF16 clips (the target)",
    "clip/calib_count": "calibrations done so far",
    "clip/calib_pool_neg": "last calibration: negative-advantage tokens in its pool (clipping.pool_neg_tokens)",
    "clip/calib_pool_steps": "last calibration: shadow steps its pool spans",
    "clip/calib_raw_low": "last calibration's low bound before smoothing (clipping.ema)",
    "clip/calib_raw_high": "last calibration's high bound before smoothing (clipping.ema)",
    "clip/calib_status": "last calibration's status as a bit flag (0 = ok); clip/calib_<flag> name the bits",
    "clip/calib_alpha_low": "last calibration: share of negative tokens BF16 clips (the quantile low aims at)",
    "clip/calib_ref_p": "last calibration: BF16's p at the standard bounds (the target)",
    "clip/calib_p": "last calibration: FP8's p at the calibrated bounds",
    "clip/calib_fp8_low_neg_standard": "last calibration: share of negative tokens FP8 clips at the standard low",
    **{
        f"clip/calib_{rule}": f"1 when the step's calibration found: {text}" for rule, text in CALIBRATION_RULES.items()
    },
}

FP8 = {
    "fp8/log_ratio_abs_diff": "shadow step: mean |log r_FP8 - log r_BF16| over response tokens (FP8's ratio noise)",
}

_EVAL_KEYS = {
    "accuracy": "held-out accuracy: mean over the evaluation sets of Avg@k (greedy accuracy with k = 1)",
    "garbled_rate": "share of evaluation answers that are garbled, mean over the sets",
    "response_len": "mean evaluation response length (tokens), mean over the sets",
    "entropy": "mean per-token entropy (nats) of the evaluation responses, mean over the sets",
    "<set>/avg_at_<k>": "Avg@k on evaluation set <set>: mean reward of k samples per problem",
    "<set>/pass_at_<k>": "Pass@k on evaluation set <set>: share of problems with a correct answer among k samples",
    "<set>/garbled_rate": "share of garbled answers on evaluation set <set>",
    "<set>/response_len": "mean response length (tokens) on evaluation set <set>",
    "<set>/entropy": "mean per-token entropy (nats) on evaluation set <set>",
}
EVAL = {
    **{f"eval/{key}": meaning for key, meaning in _EVAL_KEYS.items()},
    **{f"eval/bf16/{key}": f"as eval/{key}, evaluated in BF16 (eval.bf16)" for key in _EVAL_KEYS},
    "eval/junk_mass": "junk probe (tasks with junk tokens): the policy's probability on junk tokens at each position "
    "of the clean reference answers of the first 256 held-out problems (teacher-forced, BF16), mean over positions",
    "eval/probe_entropy": "junk probe: the policy's entropy (nats) at the same positions, mean over positions",
    "clip/overclip_neg_junk": "shadow update (tasks with junk tokens): negative-advantage junk tokens clipped in FP8 "
    "but not in BF16, / A<0 junk tokens: FP8's dose on junk",
    "clip/underclip_neg_junk": "shadow update: negative-advantage junk tokens clipped in BF16 but not in FP8, / A<0 "
    "junk tokens",
    "clip/neg_share_junk": "shadow update: junk tokens' share of the negative-advantage tokens",
    "clip/count/<sign>_<group>": "shadow step (tasks with token classes): the step's tokens of a group (a token "
    "class: junk, digit, separator, eos, other; or a p_old bucket in percent: pold_0_1, pold_1_10, pold_10_50, "
    "pold_50_100) with A<0 (sign neg) or A>0 (sign pos), summed over its shadow updates and ranks",
    "clip/count/overclip_<sign>_<group>": "shadow step: of those, clipped in FP8 but not in BF16 (the lower bound "
    "for neg, the upper for pos): FP8's over-clip, pooled as a ratio of sums",
    "clip/count/underclip_<sign>_<group>": "shadow step: of those, clipped in BF16 but not in FP8",
}

TRAIN = {
    "train/tokens": "response tokens in the step's loss",
    "train/skipped": "1 when the step was non-finite and rolled back as a whole",
    "train/nonfinite": "1 when a mini-batch's loss or gradient was non-finite",
    "train/empty_batch": "1 when DAPO dropped every group, so the step made no update",
}

TIME = {
    "time/step": "seconds of the whole step",
    "time/rollout": "seconds of generation and scoring",
    "time/old_logp": "seconds of the old-policy log-prob forward",
    "time/update": "seconds of the mini-batch updates (without the shadow and the weight push)",
    "time/shadow": "seconds of the BF16 shadow forwards (shadow and calibration steps)",
    "time/weight_push": "seconds to load the new weights into the rollout engine",
    "time/engine_sleep": "seconds the rollout engine took to free its GPU share before training (0 when it has none)",
    "time/tracking_log": "seconds the previous step's metric logging blocked the loop",
    "launch/submit_to_first_step_s": "seconds from the job's submission to its first step (launched jobs)",
}

SYSTEM = {
    "system/<name>": "MLflow's system metrics (CPU, memory, disk, network; GPU when present), every 10 s",
}

STUDIES = {  # the one-step mechanism study (fp8rl.studies.mechanism), logged to its own experiment
    "mech/logp_abs_noise": "mechanism study: mean |log pi_FP8 - log pi_BF16| of the same weights",
    "mech/log_ratio_std": "mechanism study: std of the FP8 log ratio after one update",
    "mech/ref_log_ratio_std": "mechanism study: std of the BF16 log ratio after the same update",
    "mech/tokens": "mechanism study: response tokens measured",
    "mech/neg_tokens": "mechanism study: negative tokens measured",
    "mech/outlier_scale": "mechanism study: scale of the injected activation outliers",
    "cc/low": "mechanism study: Calibrated Clipping's low bound on the cell",
    "cc/high": "mechanism study: Calibrated Clipping's high bound on the cell",
    "cc/status": "mechanism study: the calibration's status bit flag (see clip/calib_<flag>)",
    "cc/<clip metric>": "mechanism study: the clip/<clip metric> diagnostic measured with the calibrated bounds",
}

SECTIONS = {  # docs/metrics.md heading -> entries
    "rollout": ROLLOUT,
    "actor": ACTOR,
    "clip (clipping, BF16 shadow, Calibrated Clipping)": CLIP,
    "fp8": FP8,
    "eval": EVAL,
    "train": TRAIN,
    "time and launch": TIME,
    "system": SYSTEM,
    "studies": STUDIES,
}
METRICS: dict[str, str] = {key: meaning for entries in SECTIONS.values() for key, meaning in entries.items()}


@cache
def _compiled() -> list[tuple[str, re.Pattern[str]]]:
    """Exact keys first, then patterns (so ``eval/bf16/accuracy`` finds its own line, not ``eval/<set>/...``)."""
    ordered = sorted(METRICS, key=lambda key: "<" in key)
    return [(key, re.compile(re.sub(r"<[^>]+>", "[^/]+", re.escape(key)))) for key in ordered]


def entry(key: str) -> str | None:
    """The glossary key or pattern that explains the metric `key` (None: not in the glossary)."""
    return next((name for name, pattern in _compiled() if pattern.fullmatch(key)), None)


def meaning(key: str) -> str | None:
    """One line on what the metric `key` means (None: not in the glossary)."""
    name = entry(key)
    return METRICS[name] if name is not None else None


def unexplained(keys: Iterable[str]) -> list[str]:
    """The keys of `keys` that no glossary line explains, sorted."""
    return sorted({key for key in keys if entry(key) is None})


def _cell(text: str) -> str:
    """`text` as one Markdown table cell (its pipes, as in |A|, escaped)."""
    return text.replace("|", r"\|")


def glossary_markdown() -> str:
    """The glossary as Markdown tables, one per section (the docs/metrics.md block `make docs` writes)."""
    lines = []
    for heading, entries in SECTIONS.items():
        lines += [f"**{heading}**", "", "| metric | meaning |", "|---|---|"]
        lines += [f"| `{key}` | {_cell(text)} |" for key, text in entries.items()]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
