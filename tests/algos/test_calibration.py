import json
import math

import pytest
import torch

from fp8rl.algos import (
    CalibratedClipBounds,
    CalibStatus,
    ClipBounds,
    StandardClipBounds,
    TokenBatch,
    calibrate,
    calibrate_clip_bounds,
    clip_fraction_metrics,
    get_policy_loss,
    make_clip_bound_policy,
    metrics_to_floats,
    overclip_metrics,
)

EPS_LOW, EPS_HIGH = 0.2, 0.28


def f32(value: float) -> float:
    """The float32 value a bound has when compared with float32 ratios."""
    return float(torch.tensor(value, dtype=torch.float32))


def _p_loop(ratio, adv, mask, low, high):
    """Pure-python p = contrib_pos / contrib_neg (|A| r over tokens carrying gradient)."""
    pos = neg = 0.0
    for r, a, m in zip(ratio.flatten().tolist(), adv.flatten().tolist(), mask.flatten().tolist(), strict=True):
        if m and a > 0 and r < high:
            pos += a * r
        elif m and a < 0 and r > low:
            neg += -a * r
    return pos / neg


def _synthetic(seed, batch=16, length=12, sigma=0.2, noise=0.1, grid=None):
    generator = torch.Generator().manual_seed(seed)
    ratio_ref = torch.exp(torch.randn(batch, length, generator=generator) * sigma)
    ratio_fp8 = ratio_ref * torch.exp(torch.randn(batch, length, generator=generator) * noise)
    if grid is not None:  # coarse values create ties
        ratio_ref, ratio_fp8 = (torch.round(r / grid) * grid for r in (ratio_ref, ratio_fp8))
    signs = torch.tensor([-1.0, 1.0]).repeat(batch // 2 + 1)[:batch]  # both signs present
    adv = torch.randn(batch, generator=generator).abs() * signs
    mask = torch.rand(batch, length, generator=generator) < 0.85
    return ratio_ref, ratio_fp8, adv[:, None].expand(batch, length), mask


def test_lower_bound_hand_computed():
    ratio_ref = torch.tensor([[0.7, 0.9, 1.0, 1.1, 1.2, 1.0]])
    ratio_fp8 = torch.tensor([[0.75, 0.6, 0.79, 1.0, 1.3, 1.0]])
    adv = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -1.0, 1.0]])
    result = calibrate(ratio_ref, ratio_fp8, adv, torch.ones(1, 6), EPS_LOW, EPS_HIGH)
    assert result.alpha_low == pytest.approx(1 / 5)  # BF16 clips 0.7 only
    assert result.bounds.low == f32(0.6)  # the 1st smallest FP8 negative ratio
    assert result.fp8_alpha_low_standard == pytest.approx(3 / 5)  # FP8 at 0.8 would clip 0.75, 0.6, 0.79
    assert isinstance(result.bounds.low, float) and isinstance(result.bounds.high, float)


@pytest.mark.parametrize("seed", range(5))
def test_lower_bound_matches_loop_reference(seed):
    ratio_ref, ratio_fp8, adv, mask = _synthetic(seed)
    low, _ = calibrate_clip_bounds(ratio_ref, ratio_fp8, adv, mask, EPS_LOW, EPS_HIGH)
    negative = [
        (rr, rf)
        for rr, rf, a, m in zip(
            ratio_ref.flatten().tolist(),
            ratio_fp8.flatten().tolist(),
            adv.flatten().tolist(),
            mask.flatten().tolist(),
            strict=True,
        )
        if m and a < 0
    ]
    k = sum(rr <= f32(1 - EPS_LOW) for rr, _ in negative)
    assert k > 0
    assert low == sorted(rf for _, rf in negative)[k - 1]
    assert sum(rf <= low for _, rf in negative) == k  # distinct values: exactly k FP8 tokens clipped


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("grid", [None, 0.02])
def test_upper_bound_is_the_best_achievable(seed, grid):
    ratio_ref, ratio_fp8, adv, mask = _synthetic(seed, batch=6, length=8, noise=0.15, grid=grid)
    result = calibrate(ratio_ref, ratio_fp8, adv, mask, EPS_LOW, EPS_HIGH)
    low, high = result.bounds
    ref_p = _p_loop(ratio_ref, adv, mask, f32(1 - EPS_LOW), f32(1 + EPS_HIGH))
    assert result.ref_p == pytest.approx(ref_p, rel=1e-6)  # float32 products A r
    achieved = _p_loop(ratio_fp8, adv, mask, low, high)
    assert result.p == pytest.approx(achieved, rel=1e-6)
    # brute force: every achievable positive contribution is reached at some positive ratio or above all
    floor = max(1.0, low)
    positive = [
        r
        for r, a, m in zip(ratio_fp8.flatten().tolist(), adv.flatten().tolist(), mask.flatten().tolist(), strict=True)
        if m and a > 0
    ]
    candidates = [h for h in positive + [floor, max(positive) + 1.0] if h >= floor]
    best_error = min(abs(_p_loop(ratio_fp8, adv, mask, low, h) - ref_p) for h in candidates)
    assert abs(achieved - ref_p) <= best_error + 1e-6 * ref_p
    assert high >= floor


def test_identical_ratios_keep_the_clipping_and_the_standard_upper_bound():
    ratio, _, adv, mask = _synthetic(0, batch=32, length=16)
    result = calibrate(ratio, ratio, adv, mask, EPS_LOW, EPS_HIGH)
    assert result.bounds.high == f32(1 + EPS_HIGH)  # p is matched exactly there, and it is the preferred point
    assert result.p == pytest.approx(result.ref_p, rel=1e-12)
    same = clip_fraction_metrics(ratio, adv, mask, *result.bounds)
    standard = clip_fraction_metrics(ratio, adv, mask, 1 - EPS_LOW, 1 + EPS_HIGH)
    assert metrics_to_floats(same) == metrics_to_floats(standard)


def test_accepts_per_sequence_advantages_and_unpacks():
    ratio_ref, ratio_fp8, adv, mask = _synthetic(1)
    low, high = calibrate_clip_bounds(ratio_ref, ratio_fp8, adv[:, 0], mask, EPS_LOW, EPS_HIGH)
    assert ClipBounds(low, high) == calibrate_clip_bounds(ratio_ref, ratio_fp8, adv, mask, EPS_LOW, EPS_HIGH)
    assert 0 < low < 1 < high


def test_lower_bound_only_keeps_the_standard_upper_bound():
    ratio_ref, ratio_fp8, adv, mask = _synthetic(2, noise=0.3)
    full = calibrate(ratio_ref, ratio_fp8, adv, mask, EPS_LOW, EPS_HIGH)
    lower_only = calibrate(ratio_ref, ratio_fp8, adv, mask, EPS_LOW, EPS_HIGH, calibrate_high=False)
    assert lower_only.bounds.low == full.bounds.low
    assert lower_only.bounds.high == 1 + EPS_HIGH


def _degenerate_cases():
    ones = torch.ones(1, 4)
    neg_pos = torch.tensor([[-1.0, -1.0, 1.0, 1.0]])
    return {
        "empty": (ones, ones, neg_pos, torch.zeros(1, 4), CalibStatus.EMPTY),
        "no_negative": (ones, ones, torch.ones(1, 4), ones, CalibStatus.NO_NEG),
        "no_positive": (ones, ones * 0.5, -torch.ones(1, 4), ones, CalibStatus.NO_POS),
        "alpha_zero": (ones, torch.tensor([[0.3, 0.9, 1.0, 1.0]]), neg_pos, ones, CalibStatus.ALPHA_ZERO),
        "bf16_negatives_all_clipped": (ones * 0.5, ones, neg_pos, ones, CalibStatus.NO_REF_NEG_CONTRIB),
        "fp8_negatives_all_clipped": (
            torch.tensor([[0.7, 1.0, 1.0, 1.0]]),
            torch.tensor([[0.5, 0.5, 1.0, 1.0]]),
            neg_pos,
            ones,
            CalibStatus.NO_NEG_CONTRIB,
        ),
        "p_unreachable_above": (ones, torch.tensor([[1.0, 1.0, 0.1, 0.1]]), neg_pos, ones, CalibStatus.P_UNREACHABLE),
        "p_unreachable_below": (
            torch.tensor([[1.0, 1.0, 1.5, 1.5]]),
            torch.tensor([[1.0, 1.0, 0.9, 0.9]]),
            neg_pos,
            ones,
            CalibStatus.P_UNREACHABLE,
        ),
        "all_zero_advantages": (ones, ones, torch.zeros(1, 4), ones, CalibStatus.NO_NEG | CalibStatus.NO_POS),
    }


@pytest.mark.parametrize("case", list(_degenerate_cases()))
def test_degenerate_cases_are_flagged_and_finite(case):
    ratio_ref, ratio_fp8, adv, mask, flag = _degenerate_cases()[case]
    result = calibrate(ratio_ref, ratio_fp8, adv, mask, EPS_LOW, EPS_HIGH)
    assert result.status & flag == flag, result.status
    low, high = result.bounds
    assert math.isfinite(low) and math.isfinite(high) and 0 <= low <= high
    assert all(math.isfinite(v) for v in metrics_to_floats(result.metrics()).values())


def test_degenerate_fallbacks():
    cases = _degenerate_cases()
    for name in ("empty", "no_negative"):
        assert calibrate(*cases[name][:4], EPS_LOW, EPS_HIGH).bounds.low == 1 - EPS_LOW
    for name in ("empty", "no_positive", "bf16_negatives_all_clipped", "fp8_negatives_all_clipped"):
        assert calibrate(*cases[name][:4], EPS_LOW, EPS_HIGH).bounds.high == 1 + EPS_HIGH
    alpha_zero = calibrate(*cases["alpha_zero"][:4], EPS_LOW, EPS_HIGH)
    assert alpha_zero.bounds.low < f32(0.3)  # below the smallest FP8 negative ratio: FP8 clips none, as BF16
    assert alpha_zero.bounds.low == pytest.approx(0.3, rel=1e-6)
    above = calibrate(*cases["p_unreachable_above"][:4], EPS_LOW, EPS_HIGH)
    assert above.bounds.high == f32(1 + EPS_HIGH)  # every positive token keeps its gradient, the closest end
    below = calibrate(*cases["p_unreachable_below"][:4], EPS_LOW, EPS_HIGH)
    assert below.bounds.high == f32(1 + EPS_HIGH)  # r = 0.9 < min_high = 1 always keeps its gradient


def test_positive_tokens_exactly_at_the_floor_can_be_clipped():
    # BF16 clips both positive tokens (1.5 >= 1.28), so p_BF16 = 0; FP8 reaches p = 0 only with high = 1.0
    ratio_ref = torch.tensor([[1.0, 1.0, 1.5, 1.5]])
    ratio_fp8 = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    adv = torch.tensor([[-1.0, -1.0, 1.0, 1.0]])
    result = calibrate(ratio_ref, ratio_fp8, adv, torch.ones(1, 4), EPS_LOW, EPS_HIGH)
    assert result.bounds.high == 1.0
    assert result.p == 0.0 == result.ref_p
    assert not result.status & CalibStatus.P_UNREACHABLE


def test_masked_positions_are_never_read():
    ratio_ref, ratio_fp8, adv, mask = _synthetic(6)
    clean = calibrate(ratio_ref, ratio_fp8, adv, mask, EPS_LOW, EPS_HIGH)
    garbage = torch.tensor([float("nan"), float("inf"), 0.0]).repeat(mask.numel())[: mask.numel()].view_as(mask)
    poisoned = calibrate(
        torch.where(mask, ratio_ref, garbage), torch.where(mask, ratio_fp8, garbage), adv, mask, EPS_LOW, EPS_HIGH
    )
    assert poisoned == clean


def test_validation():
    ones = torch.ones(2, 3)
    with pytest.raises(ValueError, match="eps_low"):
        calibrate_clip_bounds(ones, ones, ones, ones, 1.5, 0.2)
    with pytest.raises(ValueError, match="one shape"):
        calibrate_clip_bounds(ones, torch.ones(2, 4), ones, ones, 0.2, 0.2)


# --- mechanism on synthetic data -------------------------------------------------------------------------


def _noisy_batch(noise, seed=0, batch=64, length=256):
    generator = torch.Generator().manual_seed(seed)
    old_logp = -torch.rand(batch, length, generator=generator) * 2
    bf16_log_ratio = torch.randn(batch, length, generator=generator) * 0.1
    fp8_logp = old_logp + bf16_log_ratio + torch.randn(batch, length, generator=generator) * noise
    ratio_ref = torch.exp(bf16_log_ratio)
    ratio_fp8 = torch.exp(fp8_logp - old_logp)
    adv = torch.randn(batch, generator=generator)
    mask = torch.ones(batch, length, dtype=torch.bool)
    return fp8_logp, old_logp, ratio_ref, ratio_fp8, adv, mask


def test_fp8_noise_overclips_negative_tokens_and_calibration_restores_bf16_clipping():
    standard = (1 - EPS_LOW, 1 + EPS_HIGH)
    low_neg = []
    for noise in (0.0, 0.05, 0.1, 0.2):
        _, _, ratio_ref, ratio_fp8, adv, mask = _noisy_batch(noise)
        low_neg.append(clip_fraction_metrics(ratio_fp8, adv, mask, *standard)["clip/low_neg"].item())
    assert low_neg == sorted(low_neg) and low_neg[-1] > 3 * low_neg[0] > 0

    logp, old_logp, ratio_ref, ratio_fp8, adv, mask = _noisy_batch(0.1, seed=1)
    before = overclip_metrics(ratio_ref, ratio_fp8, adv, mask, *standard, *standard)
    assert before["clip/overclip_neg"].item() > 0.02
    low, high = calibrate_clip_bounds(ratio_ref, ratio_fp8, adv, mask, EPS_LOW, EPS_HIGH)
    _, metrics = get_policy_loss("ppo_clip")(logp, TokenBatch(old_logp, adv, mask), (low, high))
    metrics.update(overclip_metrics(ratio_ref, ratio_fp8, adv, mask, low, high, *standard))  # the shadow's
    n_neg = int((adv < 0).sum()) * mask.shape[1]
    assert abs(metrics["clip/low_neg"].item() - metrics["clip/ref_low_neg"].item()) <= 2 / n_neg
    assert abs(metrics["clip/low_neg"].item() - before["clip/ref_low_neg"].item()) <= 2 / n_neg
    assert metrics["clip/p"].item() == pytest.approx(metrics["clip/ref_p"].item(), rel=0.01)
    assert low < standard[0]


# --- stateful policies ------------------------------------------------------------------------------------


def test_standard_policy_is_fixed():
    policy = make_clip_bound_policy("standard", eps_low=0.2, eps_high=0.28)
    assert isinstance(policy, StandardClipBounds)
    assert policy.bounds == (0.8, 1.28)
    assert not any(policy.needs_calibration(step) for step in range(100))
    assert metrics_to_floats(policy.metrics()) == {"clip/bound_low": 0.8, "clip/bound_high": 1.28}


def test_calibrated_policy_schedule():
    policy = make_clip_bound_policy("calibrated", interval=20)
    assert [step for step in range(41) if policy.needs_calibration(step)] == list(range(20, 41))
    policy.update(*_synthetic(0)[:4], step=20)
    assert [step for step in range(61) if policy.needs_calibration(step)] == list(range(40, 61))
    assert make_clip_bound_policy("calibrated", first_step=0).needs_calibration(0)


@pytest.mark.parametrize("ema", [0.0, 0.5, 0.9])
def test_calibrated_policy_ema_from_initial_bounds(ema):
    data = _synthetic(3, noise=0.2)
    raw_low, raw_high = calibrate_clip_bounds(*data, EPS_LOW, EPS_HIGH)
    policy = CalibratedClipBounds(eps_low=EPS_LOW, eps_high=EPS_HIGH, initial_bounds=(0.6, 1.8), ema=ema)
    assert policy.bounds == (0.6, 1.8)
    low, high = policy.update(*data, step=20)
    assert low == pytest.approx(ema * 0.6 + (1 - ema) * raw_low)
    assert high == pytest.approx(ema * 1.8 + (1 - ema) * raw_high)
    metrics = metrics_to_floats(policy.metrics())
    assert metrics["clip/bound_low"] == low and metrics["clip/calib_raw_low"] == raw_low
    assert metrics["clip/calib_count"] == 1.0


def test_calibrated_policy_lower_bound_only():
    policy = CalibratedClipBounds(eps_low=EPS_LOW, eps_high=EPS_HIGH, ema=0.0, lower_bound_only=True)
    data = _synthetic(4, noise=0.3)
    low, high = policy.update(*data, step=20)
    assert high == 1 + EPS_HIGH
    assert low == calibrate_clip_bounds(*data, EPS_LOW, EPS_HIGH).low


def test_calibrated_policy_state_dict_round_trip():
    policy = CalibratedClipBounds(eps_low=EPS_LOW, eps_high=EPS_HIGH, interval=10)
    policy.update(*_synthetic(5), step=10)
    state = json.loads(json.dumps(policy.state_dict()))  # plain python types only
    restored = CalibratedClipBounds(eps_low=EPS_LOW, eps_high=EPS_HIGH, interval=10)
    restored.load_state_dict(state)
    assert restored.bounds == policy.bounds
    assert metrics_to_floats(restored.metrics()) == metrics_to_floats(policy.metrics())
    assert [restored.needs_calibration(s) for s in (19, 20)] == [False, True]
    with pytest.raises(KeyError, match="next_step"):
        restored.load_state_dict({"low": 0.5, "high": 1.5, "last": {}})


def test_calibrated_policy_validation():
    with pytest.raises(ValueError, match="ema"):
        CalibratedClipBounds(ema=1.0)
    with pytest.raises(ValueError, match="interval"):
        CalibratedClipBounds(interval=0)
    with pytest.raises(ValueError, match="initial_bounds"):
        CalibratedClipBounds(initial_bounds=(1.5, 1.2))


# --- the calibration pool (pool_neg_tokens) ----------------------------------------------------------------


def _step_tokens(seed: int, rows: int = 4, length: int = 6):
    """(ratio_ref, ratio_fp8, adv, mask) of one small shadow step: half the rows negative."""
    generator = torch.Generator().manual_seed(seed)
    ratio_ref = torch.exp(0.1 * torch.randn(rows, length, generator=generator))
    ratio_fp8 = ratio_ref * torch.exp(0.05 * torch.randn(rows, length, generator=generator))
    adv = torch.tensor([-1.0, 1.0] * (rows // 2))
    return ratio_ref, ratio_fp8, adv, torch.ones(rows, length)


def _concatenated(steps):
    return tuple(torch.cat([step[i] for step in steps]) for i in range(4))


def test_pool_of_zero_calibrates_on_its_own_step():
    old, new = _step_tokens(0), _step_tokens(1)
    policy = CalibratedClipBounds(eps_low=EPS_LOW, eps_high=EPS_HIGH, ema=0.0)
    policy.observe(*old)
    assert not policy.wants_shadow(3)  # one step always fills a pool of 0: shadows on calibration steps only
    assert policy.update(*new, step=20) == calibrate_clip_bounds(*new, EPS_LOW, EPS_HIGH)
    assert metrics_to_floats(policy.metrics())["clip/calib_pool_steps"] == 1.0


def test_pool_holds_the_newest_steps_that_reach_the_token_count():
    steps = [_step_tokens(seed) for seed in range(5)]  # 12 negative tokens each
    policy = CalibratedClipBounds(eps_low=EPS_LOW, eps_high=EPS_HIGH, ema=0.0, pool_neg_tokens=30)
    assert policy.wants_shadow(0)  # an empty pool: the shadow runs on every step
    for step in steps[:4]:
        policy.observe(*step)
    assert policy.wants_shadow(1)  # one step (12) does not fill 30
    bounds = policy.update(*steps[4], step=20)
    assert bounds == calibrate_clip_bounds(*_concatenated(steps[2:]), EPS_LOW, EPS_HIGH)  # 3 x 12 >= 30 > 2 x 12
    metrics = metrics_to_floats(policy.metrics())
    assert (metrics["clip/calib_pool_neg"], metrics["clip/calib_pool_steps"]) == (36.0, 3.0)


def test_pool_resolves_a_clipped_share_one_step_cannot():
    # BF16 clips 1 negative token in 100; steps of 20 negative tokens mostly see none (ALPHA_ZERO)
    generator = torch.Generator().manual_seed(7)
    steps = []
    for _ in range(30):
        ratio_ref = torch.where(torch.rand(20, 1, generator=generator) < 0.01, 0.7, 0.95)
        ratio_fp8 = ratio_ref * torch.exp(0.08 * torch.randn(20, 1, generator=generator))
        steps.append((ratio_ref, ratio_fp8, -torch.ones(20), torch.ones(20, 1)))
    single = CalibratedClipBounds(eps_low=EPS_LOW, eps_high=EPS_HIGH, ema=0.0, interval=1)
    pooled = CalibratedClipBounds(eps_low=EPS_LOW, eps_high=EPS_HIGH, ema=0.0, interval=1, pool_neg_tokens=400)
    statuses = {"single": [], "pooled": []}
    for step, tokens in enumerate(steps, start=1):
        for name, policy in (("single", single), ("pooled", pooled)):
            policy.update(*tokens, step=step)
            statuses[name].append(int(metrics_to_floats(policy.metrics())["clip/calib_status"]))
    alpha_zero = int(CalibStatus.ALPHA_ZERO)
    assert sum(s & alpha_zero != 0 for s in statuses["single"]) > 20
    assert all(s & alpha_zero == 0 for s in statuses["pooled"][-10:])


def test_pool_survives_a_checkpoint():
    policy = CalibratedClipBounds(eps_low=EPS_LOW, eps_high=EPS_HIGH, ema=0.0, pool_neg_tokens=30)
    for seed in range(3):
        policy.observe(*_step_tokens(seed))
    restored = CalibratedClipBounds(eps_low=EPS_LOW, eps_high=EPS_HIGH, ema=0.0, pool_neg_tokens=30)
    restored.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    last = _step_tokens(9)
    assert restored.update(*last, step=20) == policy.update(*last, step=20)
    assert restored.wants_shadow(21) == policy.wants_shadow(21)
    with pytest.raises(ValueError, match="pool_neg_tokens"):
        CalibratedClipBounds(pool_neg_tokens=-1)
