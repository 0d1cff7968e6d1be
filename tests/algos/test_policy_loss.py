import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8rl.algos import CorrectionParams, Objective, TokenBatch, aggregate_loss, get_policy_loss

METRIC_PREFIXES = ("actor/", "clip/", "fp8/", "rollout/")


def loss_of(name):
    """The loss `name` called as the trainer calls it, from the tests' keyword arguments: its options bound with
    ``configured``, the rollout correction computed once by the objective (its metrics merged, as the trainer
    logs them), the tensors in a ``TokenBatch``."""

    def call(logp, old, adv, mask, *, clip_low, clip_high, rollout_logp=None, rollout_correction=None,
             tis_cap=None, grad_zero_mask=None, **options):  # fmt: skip
        loss_fn = get_policy_loss(name).configured(**options)
        params = CorrectionParams() if tis_cap is None else CorrectionParams(tis_cap)
        objective = Objective(loss_fn, rollout_correction, params)
        correction = objective.correct(old, rollout_logp, mask)
        loss, metrics = loss_fn(
            logp, TokenBatch(old, adv, mask, correction, None, grad_zero_mask), (clip_low, clip_high)
        )
        return loss, {**metrics, **correction.metrics}

    return call


def _logp_for(ratios, dtype=torch.float64):
    """logp (1, n) with old_logp = 0, so that ratio = exp(logp)."""
    logp = torch.log(torch.tensor([ratios], dtype=dtype)).requires_grad_(True)
    return logp, torch.zeros_like(logp)


def test_ppo_clip_value_hand_computed():
    logp, old = _logp_for([0.5, 1.0, 1.5, 0.5, 1.0, 1.5])
    adv = torch.tensor([[-1.0, -1.0, -1.0, 2.0, 2.0, 2.0]], dtype=torch.float64)
    loss, _ = loss_of("ppo_clip")(logp, old, adv, torch.ones_like(logp), clip_low=0.8, clip_high=1.2)
    # A < 0: 0.5 -> clipped at 0.8; 1.0; 1.5 -> unclipped (min picks r A). A > 0: 0.5 unclipped; 1.0; 1.5 -> 1.2
    per_token = [0.8, 1.0, 1.5, -1.0, -2.0, -2.4]
    assert loss.item() == pytest.approx(sum(per_token) / 6)


def test_ppo_clip_zero_gradient_pattern():
    ratios = [0.5, 0.9, 1.1, 1.5, 0.5, 0.9, 1.1, 1.5, 1.0]
    adv = torch.tensor([[-1.0] * 4 + [1.0] * 4 + [0.0]], dtype=torch.float64)
    logp, old = _logp_for(ratios)
    loss, _ = loss_of("ppo_clip")(logp, old, adv, torch.ones_like(logp), clip_low=0.8, clip_high=1.2)
    loss.backward()
    ratio = torch.tensor(ratios, dtype=torch.float64)
    expected = -adv[0] * ratio / len(ratios)  # d(-A r)/d logp = -A r, token-mean over 9 tokens
    expected[0] = 0.0  # A < 0, r <= clip_low
    expected[7] = 0.0  # A > 0, r >= clip_high
    torch.testing.assert_close(logp.grad[0], expected)
    assert logp.grad[0, 0] == 0 and logp.grad[0, 7] == 0
    assert torch.all(logp.grad[0, [1, 2, 3, 4, 5, 6]] != 0)  # incl. A < 0 with r > clip_high: PPO keeps it


@pytest.mark.parametrize("name", ["ppo_clip", "dual_clip"])
def test_ratio_exactly_at_the_bound_gets_zero_gradient(name):
    # logp = old_logp gives r = 1 exactly; torch.maximum / clamp would pass gradient at such ties
    logp = torch.zeros(1, 2, requires_grad=True)
    adv = torch.tensor([[-1.0, 1.0]])
    loss_fn = loss_of(name)
    loss_fn(logp, torch.zeros(1, 2), adv, torch.ones(1, 2), clip_low=1.0, clip_high=1.5)[0].backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] != 0
    logp.grad = None
    loss_fn(logp, torch.zeros(1, 2), adv, torch.ones(1, 2), clip_low=0.5, clip_high=1.0)[0].backward()
    assert logp.grad[0, 0] != 0 and logp.grad[0, 1] == 0


def test_dual_clip_caps_negative_loss():
    logp, old = _logp_for([0.5, 1.0, 2.0, 4.0, 4.0])
    adv = torch.tensor([[-1.0, -1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    loss, metrics = loss_of("dual_clip")(
        logp, old, adv, torch.ones_like(logp), clip_low=0.8, clip_high=1.2, dual_clip_c=3.0
    )
    # per token: 0.8 (low clip), 1.0, 2.0 (above high, below c: r A kept), 3.0 (capped at -c A), -1.2 (high clip)
    assert loss.item() == pytest.approx((0.8 + 1.0 + 2.0 + 3.0 - 1.2) / 5)
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 3] == 0 and logp.grad[0, 4] == 0
    assert logp.grad[0, 1] != 0 and logp.grad[0, 2] != 0
    assert metrics["clip/dual_neg"].item() == pytest.approx(1 / 4)


def test_dual_clip_default_c_is_3_and_validated():
    logp, old = _logp_for([3.5])
    adv = torch.tensor([-1.0], dtype=torch.float64)
    loss, _ = loss_of("dual_clip")(logp, old, adv, torch.ones_like(logp), clip_low=0.8, clip_high=1.2)
    assert loss.item() == pytest.approx(3.0)
    with pytest.raises(ValueError, match="dual_clip_c"):
        loss_of("dual_clip")(logp, old, adv, torch.ones_like(logp), clip_low=0.8, clip_high=1.2, dual_clip_c=1)


def test_cispo_keeps_every_gradient_with_clipped_weight():
    ratios = [0.5, 1.0, 1.5]
    logp, old = _logp_for(ratios)
    adv = torch.tensor([[-1.0, 2.0, 2.0]], dtype=torch.float64)
    loss, _ = loss_of("cispo")(logp, old, adv, torch.ones_like(logp), clip_low=0.8, clip_high=1.2)
    assert loss.item() == pytest.approx((0.8 - 2.0 - 2.4) / 3)
    loss.backward()
    torch.testing.assert_close(logp.grad[0], torch.tensor([0.8, -2.0, -2.4], dtype=torch.float64) / 3)


def _reference_ppo(logp, old_logp, adv, mask, clip_low, clip_high, dual_clip_c=None):
    """Textbook formula: -min(r A, clip(r) A), dual: for A < 0, -max(min(...), c A)."""
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, clip_low, clip_high) * adv)
    if dual_clip_c is not None:
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, dual_clip_c * adv), surrogate)
    return aggregate_loss(-surrogate, mask, "token-mean")


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", ["ppo_clip", "dual_clip"])
def test_matches_textbook_formula_value_and_gradient(seed, name):
    generator = torch.Generator().manual_seed(seed)
    shape = (6, 20)
    old = -torch.rand(shape, generator=generator, dtype=torch.float64) * 3
    logp = (old + torch.randn(shape, generator=generator, dtype=torch.float64) * 0.6).requires_grad_(True)
    adv = torch.randn(6, generator=generator, dtype=torch.float64)
    mask = torch.rand(shape, generator=generator) < 0.8
    kwargs = {"dual_clip_c": 1.6} if name == "dual_clip" else {}
    loss, _ = loss_of(name)(logp, old, adv, mask, clip_low=0.75, clip_high=1.3, **kwargs)
    (grad,) = torch.autograd.grad(loss, logp)
    ref_logp = logp.detach().clone().requires_grad_(True)
    ref = _reference_ppo(ref_logp, old, adv[:, None], mask, 0.75, 1.3, kwargs.get("dual_clip_c"))
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, ref_grad)


@settings(max_examples=40, deadline=None)
@given(
    log_ratios=st.lists(st.floats(-1.5, 1.5), min_size=1, max_size=12),
    signs=st.lists(st.sampled_from([-1.0, 0.0, 1.0]), min_size=12, max_size=12),
)
def test_gradient_is_zero_exactly_on_clipped_tokens(log_ratios, signs):
    n = len(log_ratios)
    logp = torch.tensor([log_ratios], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([signs[:n]], dtype=torch.float64)
    loss, _ = loss_of("ppo_clip")(
        logp, torch.zeros_like(logp), adv, torch.ones_like(logp), clip_low=0.8, clip_high=1.25
    )
    loss.backward()
    ratio = torch.exp(logp.detach())
    zeroed = ((adv < 0) & (ratio <= 0.8)) | ((adv > 0) & (ratio >= 1.25)) | (adv == 0)
    assert torch.all((logp.grad == 0) == zeroed)
    assert torch.isfinite(loss)


def test_per_sequence_and_per_token_advantages_agree():
    generator = torch.Generator().manual_seed(1)
    logp, old = torch.randn(4, 7, generator=generator), torch.randn(4, 7, generator=generator)
    adv, mask = torch.randn(4, generator=generator), torch.ones(4, 7)
    loss_fn = loss_of("ppo_clip")
    a, _ = loss_fn(logp, old, adv, mask, clip_low=0.8, clip_high=1.2)
    b, _ = loss_fn(logp, old, adv[:, None].expand(4, 7), mask, clip_low=0.8, clip_high=1.2)
    assert torch.equal(a, b)


def test_aggregation_mode_is_passed_through():
    generator = torch.Generator().manual_seed(2)
    logp, old = torch.randn(3, 5, generator=generator), torch.randn(3, 5, generator=generator)
    adv, mask = torch.randn(3, generator=generator), torch.rand(3, 5, generator=generator) < 0.6
    token_loss, _ = loss_of("ppo_clip")(logp, old, adv, mask, clip_low=0.0, clip_high=1e9)  # never clips
    per_token = -adv[:, None] * torch.exp(logp - old)
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        loss, _ = loss_of("ppo_clip")(logp, old, adv, mask, clip_low=0.0, clip_high=1e9, agg=mode)
        torch.testing.assert_close(loss, aggregate_loss(per_token, mask, mode))
    torch.testing.assert_close(token_loss, aggregate_loss(per_token, mask, "token-mean"))


def test_token_tis_multiplies_the_loss_with_a_stop_gradient_weight():
    logp = torch.zeros(1, 3, requires_grad=True)
    old = torch.zeros(1, 3, requires_grad=True)
    rollout = torch.log(torch.tensor([[2.0, 1.0, 0.25]]))  # rho = pi_old / pi_rollout = [0.5, 1, 4]
    adv, mask = torch.tensor([1.0]), torch.ones(1, 3)
    loss, metrics = loss_of("ppo_clip")(
        logp, old, adv, mask, clip_low=0.8, clip_high=1.2, rollout_logp=rollout, tis_cap=3.0
    )
    assert loss.item() == pytest.approx(-(0.5 + 1.0 + 3.0) / 3)  # r = 1, weights [0.5, 1, min(4, 3)]
    loss.backward()
    torch.testing.assert_close(logp.grad, -torch.tensor([[0.5, 1.0, 3.0]]) / 3)
    assert old.grad is None  # neither the ratio's denominator nor the TIS weight carries gradient
    assert metrics["rollout/tis_max"].item() == 3.0
    assert metrics["rollout/tis_trunc_frac"].item() == pytest.approx(1 / 3)


def test_rollout_logp_defaults_to_token_tis_with_cap_2_and_none_disables():
    logp, old = torch.zeros(1, 2), torch.zeros(1, 2)
    rollout = torch.log(torch.tensor([[0.2, 1.0]]))  # rho = [5, 1]
    loss_fn = loss_of("ppo_clip")
    kwargs = {"clip_low": 0.8, "clip_high": 1.2}
    default, _ = loss_fn(logp, old, torch.tensor([-1.0]), torch.ones(1, 2), rollout_logp=rollout, **kwargs)
    assert default.item() == pytest.approx((2.0 + 1.0) / 2)
    plain, _ = loss_fn(logp, old, torch.tensor([-1.0]), torch.ones(1, 2), **kwargs)
    off, metrics = loss_fn(
        logp, old, torch.tensor([-1.0]), torch.ones(1, 2), rollout_logp=rollout, rollout_correction="none", **kwargs
    )
    ignored, _ = loss_fn(logp, old, torch.tensor([-1.0]), torch.ones(1, 2), tis_cap=1.5, **kwargs)
    assert plain.item() == off.item() == ignored.item() == pytest.approx(1.0)
    assert "rollout/token_mult_prob_error" in metrics and "rollout/tis_mean" not in metrics


def test_mis_removes_tokens_from_the_mean():
    logp, old = torch.zeros(1, 3), torch.zeros(1, 3)
    rollout = torch.log(torch.tensor([[1.0, 1.0, 0.1]]))  # rho = [1, 1, 10]
    adv = torch.tensor([[-1.0, -3.0, -100.0]])
    loss, metrics = loss_of("ppo_clip")(
        logp,
        old,
        adv,
        torch.ones(1, 3),
        clip_low=0.8,
        clip_high=1.2,
        rollout_logp=rollout,
        rollout_correction="mis_token",
    )
    assert loss.item() == pytest.approx((1.0 + 3.0) / 2)
    assert metrics["rollout/mis_masked_frac"].item() == pytest.approx(1 / 3)


def test_metrics_are_namespaced_detached_scalars():
    generator = torch.Generator().manual_seed(3)
    logp = torch.randn(4, 6, generator=generator).requires_grad_(True)
    old, rollout = torch.randn(4, 6, generator=generator), torch.randn(4, 6, generator=generator)
    _, metrics = loss_of("dual_clip")(
        logp,
        old,
        torch.randn(4),
        torch.ones(4, 6),
        clip_low=0.8,
        clip_high=1.28,
        rollout_logp=rollout,
    )
    expected_keys = {
        "actor/pg_loss",
        "actor/ratio_q01",
        "actor/ratio_q50",
        "actor/ratio_q99",
        "actor/ppo_kl",
        "clip/low_neg",
        "clip/high_pos",
        "clip/low_pos",
        "clip/high_neg",
        "clip/frac",
        "clip/p",
        "rollout/tis_mean",
        "rollout/abs_logp_diff",
        "rollout/k3_kl",
    }
    assert expected_keys <= set(metrics)
    for key, value in metrics.items():
        assert key.startswith(METRIC_PREFIXES), key
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad, key
        assert torch.isfinite(value), key


def test_diagnostics_off_returns_only_the_loss_metric():
    _, metrics = loss_of("ppo_clip")(
        torch.zeros(2, 3),
        torch.zeros(2, 3),
        torch.ones(2),
        torch.ones(2, 3),
        clip_low=0.8,
        clip_high=1.2,
        diagnostics=False,
    )
    assert set(metrics) == {"actor/pg_loss"}


@pytest.mark.parametrize("name", ["ppo_clip", "dual_clip", "cispo"])
def test_all_masked_and_garbage_in_padding_give_no_nan(name):
    logp = torch.full((2, 4), float("nan")).requires_grad_(True)
    old = torch.full((2, 4), float("inf"))
    loss, metrics = loss_of(name)(
        logp,
        old,
        torch.ones(2),
        torch.zeros(2, 4),
        clip_low=0.8,
        clip_high=1.2,
        rollout_logp=old,
    )
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logp.grad, torch.zeros(2, 4))
    assert all(math.isfinite(v.item()) for v in metrics.values())


def test_argument_validation():
    loss_fn = loss_of("ppo_clip")
    args = (torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="clip_low <= clip_high"):
        loss_fn(*args, clip_low=1.3, clip_high=1.2)
    with pytest.raises(TypeError):
        loss_fn(*args, clip_low=0.8, clip_high=1.2, dual_clip_c=3.0)  # not an option of ppo_clip
    with pytest.raises(ValueError, match="one shape"):
        loss_fn(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2), torch.ones(2, 3), clip_low=0.8, clip_high=1.2)
    with pytest.raises(ValueError, match="adv"):
        loss_fn(*args[:2], torch.ones(3), args[3], clip_low=0.8, clip_high=1.2)
    with pytest.raises(KeyError, match="cispo, dual_clip, ppo_clip, vanilla"):
        get_policy_loss("grpo_clip")


def test_bf16_log_probs_are_upcast():
    logp = torch.randn(2, 5, generator=torch.Generator().manual_seed(4))
    loss_bf16, _ = loss_of("ppo_clip")(
        logp.bfloat16(), torch.zeros(2, 5).bfloat16(), torch.ones(2), torch.ones(2, 5), clip_low=0.8, clip_high=1.2
    )
    assert loss_bf16.dtype == torch.float32


def test_synthetic_overclip_zeroes_exactly_the_negative_tokens_the_noise_pushes_out():
    from fp8rl.algos import synthetic_overclip_mask

    log_ratio = torch.log(torch.tensor([[0.9, 0.9, 0.9, 0.7, 0.9, 1.0]], dtype=torch.float64))
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0, 1]])
    noise = torch.tensor([[-0.2, 0.0, -0.5, -0.5, -0.5, -0.1]])
    zeroed = synthetic_overclip_mask(log_ratio, adv, mask, noise, clip_low=0.8)
    # token 0: log 0.9 - 0.2 < log 0.8 -> over-clipped; 1: no noise; 2: A > 0; 3: BF16 clips it already;
    # 4: masked out; 5: log 1.0 - 0.1 > log 0.8
    assert zeroed.tolist() == [[True, False, False, False, False, False]]


def test_grad_zero_mask_keeps_the_value_and_removes_the_gradient():
    logp, old = _logp_for([0.9, 1.1, 0.95])
    adv = torch.tensor([[-1.0, 1.0, -1.0]], dtype=torch.float64)
    loss_fn = loss_of("ppo_clip")
    plain, _ = loss_fn(logp, old, adv, torch.ones_like(logp), clip_low=0.8, clip_high=1.2)
    zero = torch.tensor([[True, False, False]])
    masked, metrics = loss_fn(logp, old, adv, torch.ones_like(logp), clip_low=0.8, clip_high=1.2, grad_zero_mask=zero)
    assert masked.item() == pytest.approx(plain.item())
    masked.backward()
    assert logp.grad[0, 0] == 0 and torch.all(logp.grad[0, 1:] != 0)
    assert metrics["clip/synthetic_overclip_neg"].item() == pytest.approx(0.5)  # 1 of the 2 A < 0 tokens


def test_options_are_bound_once_and_unknown_ones_refused_before_a_call():
    dual = get_policy_loss("dual_clip")
    assert dual.option_names == ("dual_clip_c",) and get_policy_loss("ppo_clip").option_names == ()
    bound = dual.configured(agg="seq-mean-token-mean", dual_clip_c=2.0)
    assert (bound.agg, dict(bound.options)) == ("seq-mean-token-mean", {"dual_clip_c": 2.0})
    assert dual.agg == "token-mean" and dict(dual.options) == {}  # the registered entry is left as it was
    with pytest.raises(TypeError, match="takes no option dual_clip_c"):
        get_policy_loss("cispo").configured(dual_clip_c=3.0)


def test_the_class_targeted_removal_drops_negative_junk_at_its_share_or_as_many_other_tokens():
    """The junk organism's controls: share 1 drops every A < 0 junk token (and nothing else); matched_other drops
    the same count of A < 0 non-junk tokens; positive-advantage and masked tokens are never dropped."""
    from fp8rl.algos import synthetic_class_drop_mask

    adv = torch.tensor([-1.0, -1.0, 1.0])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]])
    junk = torch.tensor([[True, False, False, True], [False, True, False, True], [True, True, False, False]])
    uniform = torch.tensor([[0.1, 0.5, 0.2, 0.7], [0.3, 0.4, 0.05, 0.0], [0.0, 0.0, 0.0, 0.0]])
    every = synthetic_class_drop_mask(adv, mask, junk, uniform, 1.0)
    assert every.tolist() == [[True, False, False, True], [False, True, False, False], [False] * 4]
    some = synthetic_class_drop_mask(adv, mask, junk, uniform, 0.5)
    assert some.tolist() == [[True, False, False, False], [False, True, False, False], [False] * 4]
    matched = synthetic_class_drop_mask(adv, mask, junk, uniform, 1.0, matched_other=True)
    assert int(matched.sum()) == int(every.sum()) == 3
    assert not (matched & junk).any() and not matched[2].any() and not matched[1, 3]
    # the A < 0 non-junk tokens with the smallest draws: 0.05, 0.2, 0.3 (not 0.5)
    assert matched.tolist() == [[False, False, True, False], [True, False, True, False], [False] * 4]
    none = synthetic_class_drop_mask(adv, mask, junk, uniform, 0.0, matched_other=True)
    assert not none.any()
