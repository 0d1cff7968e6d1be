"""fp8_linear: forward and gradients against references with derived bounds, recipes, state, caching.

Notation: a GEMM C = A B^T with A (rows, n) and B (cols, n) reduces over n. Each operand element is
quantized with a block scale s and dequantized to a_hat with (see test_tensor.py)

    |a_hat - a| <= u_a |a| + eta_a,   u = 2^-(m+1) (+2^-22 for a non-power-of-two scale),
                                      eta = s * 2^(emin - m - 1) (subnormal half-spacing).

Two references, two bounds:

1. Composition (tight). fp8_linear must equal the float64 product of the fake-quantized operands,
   A_hat B_hat^T, up to float32 accumulation: products of FP8 values are exact in float32, and
   recursive summation of n terms errs by at most gamma_n sum_k |a_hat_k||b_hat_k| with
   gamma_n ~ n 2^-24; scale multiplications and the output cast add a few 2^-24 relative:

       |C - A_hat B_hat^T| <= (n + 6) 2^-24 (|A_hat| |B_hat|^T).

   This pins every operand's granularity, format and orientation (a wrong one costs ~2^-5).

2. FP32 reference (what FP8 costs). Against C_ref = A B^T, expanding a_hat b_hat - a b:

       |C - C_ref| <= (u_a + u_b + u_a u_b) |A||B|^T + (1 + u_b) eta_A |B|^T + (1 + u_a) |A| eta_B^T
                      + eta_A eta_B^T + (n + 6) 2^-24 |A_hat||B_hat|^T,

   elementwise, i.e. the (2u + u^2) sum_k |a_k||b_k| bound of the issue plus subnormal terms.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from fp8rl.quant import DelayedScalingState, fake_quantize, fp8_linear, get_format, get_recipe, quantize
from fp8rl.quant.granularity import TRANSPOSED
from fp8rl.quant.tensor import expand_scale

linear_module = importlib.import_module("fp8rl.quant.linear")

RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8")
M, K, N = 37, 200, 70  # partial 128-blocks and 32-blocks along every dimension


def operand(t: torch.Tensor, granularity: str, fmt: str, pow2: bool, amax: torch.Tensor | None = None):
    """(a_hat, |a|, eta, u) of one operand in float64, in t's orientation."""
    q = quantize(t.detach().float(), fmt, granularity, pow2, amax=amax)
    spec = get_format(fmt)
    scale = expand_scale(q.scale, granularity, t.shape).double()
    eta = scale * 2.0 ** (1 - spec.exponent_bias - spec.mantissa_bits - 1)
    exact_scale = pow2 or granularity.startswith("mx") or bool((torch.frexp(q.scale)[0] == 0.5).all())
    u = 2.0 ** -(spec.mantissa_bits + 1) + (0.0 if exact_scale else 2.0**-22)
    return q.dequantize(torch.float32).double(), t.detach().double().abs(), eta, u


def gemm_bounds(a, b, n: int):
    """(composition reference, tight bound, fp32-reference bound) for A B^T from two `operand` tuples."""
    a_hat, a_abs, eta_a, u_a = a
    b_hat, b_abs, eta_b, u_b = b
    composed = a_hat @ b_hat.T
    accumulation = (n + 6) * 2.0**-24 * (a_hat.abs() @ b_hat.abs().T)
    quantization = (
        (u_a + u_b + u_a * u_b) * (a_abs @ b_abs.T)
        + (1 + u_b) * (eta_a @ b_abs.T)
        + (1 + u_a) * (a_abs @ eta_b.T)
        + eta_a @ eta_b.T
    )
    return composed, accumulation, quantization + accumulation


def transposed(op):
    return tuple(t.T if isinstance(t, torch.Tensor) else t for t in op)


def recipe_bounds(x, w, dy, recipe):
    """Composition references and bounds for y = x W^T, dx = dy W, dW = dy^T x under `recipe`."""
    pow2 = recipe.uses_pow2_scales
    act, wgt, grad = recipe.activation_granularity, recipe.weight_granularity, recipe.gradient_granularity
    fwd, bwd = recipe.forward_format, recipe.backward_format
    y = gemm_bounds(operand(x, act, fwd, pow2), operand(w, wgt, fwd, pow2), x.shape[1])
    # dgrad: A = dy (M, N) scaled along N, B = W^T (K, N) scaled along N: W quantized columnwise.
    dx = gemm_bounds(operand(dy, grad, bwd, pow2), transposed(operand(w, TRANSPOSED[wgt], fwd, pow2)), w.shape[0])
    # wgrad: A = dy^T (N, M) and B = x^T (K, M), both scaled along M: dy and x quantized columnwise.
    dw = gemm_bounds(
        transposed(operand(dy, TRANSPOSED[grad], bwd, pow2)),
        transposed(operand(x, TRANSPOSED[act], fwd, pow2)),
        x.shape[0],
    )
    return y, dx, dw


def run_linear(x, w, b, dy, recipe, state=None):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    b = None if b is None else b.clone().requires_grad_()
    y = fp8_linear(x, w, b, recipe, state)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, None if b is None else b.grad


def inputs(seed: int, m: int = M, k: int = K, n: int = N):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.empty(m, 1).uniform_(-6, 6, generator=g))
    x[:, :3] *= 50  # outlier channels
    w = torch.randn(n, k, generator=g) / math.sqrt(k)
    dy = torch.randn(m, n, generator=g) * 1e-3
    b = torch.randn(n, generator=g)
    return x, w, b, dy


def assert_within(actual: torch.Tensor, reference: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    excess = (actual.detach().double() - reference).abs() - bound
    assert bool((excess <= 0).all()), f"{what}: bound exceeded by {float(excess.max()):.3g}"


# ---------------------------------------------------------------- numerics of the three GEMMs


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("name", RECIPES)
def test_forward_and_gradients_equal_the_fake_quantized_composition(name, fmt):
    """Bound 1 (module docstring): (n + 6) 2^-24 |A_hat||B_hat|^T around A_hat B_hat^T, for y, dx, dW."""
    recipe = get_recipe(name, fmt=fmt)
    x, w, b, dy = inputs(seed=1)
    y, dx, dw, db = run_linear(x, w, b, dy, recipe)
    (y_ref, y_tol, _), (dx_ref, dx_tol, _), (dw_ref, dw_tol, _) = recipe_bounds(x, w, dy, recipe)
    y_ref = y_ref + b.double()
    assert_within(y, y_ref, y_tol + 2.0**-24 * y_ref.abs(), "y")  # + the bias addition's rounding
    assert_within(dx, dx_ref, dx_tol, "dx")
    assert_within(dw, dw_ref, dw_tol, "dW")
    assert_within(db, dy.double().sum(0), M * 2.0**-24 * dy.double().abs().sum(0), "db")


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("pow2", [False, True])
def test_forward_and_gradients_are_within_the_derived_bound_of_fp32(name, fmt, pow2):
    """Bound 2 (module docstring): (u_a + u_b + u_a u_b) |A||B|^T + subnormal terms + accumulation.

    u = 2^-4 for E4M3 operands, 2^-3 for the E5M2 gradients of "hybrid".
    """
    recipe = get_recipe(name, fmt=fmt, pow2_scale=pow2 or name == "mxfp8")
    x, w, _, dy = inputs(seed=2)
    y, dx, dw, _ = run_linear(x, w, None, dy, recipe)
    (_, _, y_bound), (_, _, dx_bound), (_, _, dw_bound) = recipe_bounds(x, w, dy, recipe)
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    assert_within(y, x64 @ w64.T, y_bound, "y")
    assert_within(dx, dy64 @ w64, dx_bound, "dx")
    assert_within(dw, dy64.T @ x64, dw_bound, "dW")


def test_float16_inputs_do_not_overflow():
    """Raw FP8 products reach 448^2 > float16's max; the raw-value GEMM must not run in float16."""
    x, w, _, _ = inputs(seed=3, m=16, k=64, n=32)
    x, w = (x / x.abs().max() * 100).half(), w.half()
    for name in RECIPES:
        y = fp8_linear(x, w, None, name)
        assert y.dtype == torch.float16 and bool(torch.isfinite(y).all()), name
        y32 = fp8_linear(x.float(), w.float(), None, name)
        assert torch.equal(y, y32.half()), name


# ---------------------------------------------------------------- the paper's ordering of granularities


def llm_activations(seed: int, tokens: int = 256, channels: int = 512, out_features: int = 384):
    """Activations as LLMs have them, and Gaussian weights.

    Per-token magnitudes spread over ~100x, 4 outlier channels at 100x, and 2 "massive activation"
    tokens with 1e4 in two of those channels (Sun et al., 2024).
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, channels, generator=g)
    x *= torch.exp(torch.empty(tokens, 1).uniform_(-4.6, 0, generator=g))
    outlier_channels = torch.randperm(channels, generator=g)[:4]
    x[:, outlier_channels] *= 100
    massive_tokens = torch.randperm(tokens, generator=g)[:2]
    x[massive_tokens[:, None], outlier_channels[None, :2]] = 1e4
    w = torch.randn(out_features, channels, generator=g) / channels**0.5
    return x, w


def per_token_error(name: str, x: torch.Tensor, w: torch.Tensor, pow2: bool) -> float:
    """Mean over tokens of ||y_hat_i - y_i|| / ||y_i|| for the forward output."""
    y_ref = x.double() @ w.double().T
    y = fp8_linear(x, w, None, get_recipe(name, pow2_scale=pow2)).double()
    return float(((y - y_ref).norm(dim=1) / y_ref.norm(dim=1)).mean())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_error_ordering_tensorwise_rowwise_blockwise_with_float32_scales(seed):
    """tensorwise > rowwise > blockwise on LLM-like activations, all three with float32 scales.

    Two mechanisms, both granularity effects: (a) a massive-activation token sets the per-tensor
    scale so high that ordinary tokens fall into E4M3's subnormals (rowwise removes this), and
    (b) a float32 scale maps each group's amax exactly onto 448, so finer groups represent more of
    the outliers that dominate the output exactly (blockwise: one per 128 channels, not per row).
    """
    x, w = llm_activations(seed)
    tensorwise, rowwise, blockwise = (per_token_error(name, x, w, pow2=False) for name in RECIPES[:3])
    assert tensorwise > 1.3 * rowwise, (tensorwise, rowwise)
    assert rowwise > 1.01 * blockwise, (rowwise, blockwise)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_error_ordering_with_power_of_two_scales_comes_only_from_underflow(seed):
    """With power-of-two scales, FP8 rounding commutes with the scale for normal-range values, so
    granularity changes only what underflows: tensorwise is far worse (massive tokens), while rowwise
    and blockwise (no in-row underflow at these magnitudes) agree up to float32 accumulation order.
    """
    x, w = llm_activations(seed)
    tensorwise, rowwise, blockwise = (per_token_error(name, x, w, pow2=True) for name in RECIPES[:3])
    assert tensorwise > 1.3 * rowwise, (tensorwise, rowwise)
    assert blockwise <= rowwise * (1 + 1e-4), (rowwise, blockwise)


# ---------------------------------------------------------------- layer behaviour


def test_bias_is_added_in_high_precision():
    x, w, b, dy = inputs(seed=4)
    y_bias, _, _, db = run_linear(x, w, b, dy, "rowwise")
    y_none = fp8_linear(x, w, None, "rowwise")
    assert torch.equal(y_bias, y_none + b)
    assert_within(db, dy.double().sum(0), M * 2.0**-24 * dy.double().abs().sum(0), "db")


@pytest.mark.parametrize("name", RECIPES)
def test_leading_dimensions_are_flattened(name):
    x, w, b, dy = inputs(seed=5, m=2 * 3 * 8)
    x3, dy3 = x.reshape(6, 8, K), dy.reshape(6, 8, N)
    y3, dx3, dw3, db3 = run_linear(x3, w, b, dy3, name)
    y, dx, dw, db = run_linear(x, w, b, dy, name)
    assert y3.shape == (6, 8, N) and dx3.shape == x3.shape
    assert torch.equal(y3.reshape(-1, N), y) and torch.equal(dx3.reshape(-1, K), dx)
    assert torch.equal(dw3, dw) and torch.equal(db3, db)


@pytest.mark.parametrize("name", RECIPES)
def test_autocast_bf16_output_dtype_and_accuracy(name):
    """Under CPU autocast the output is bf16 and grads keep the parameters' dtypes.

    Against the float32 path: the GEMM output g is rounded to bf16 (unit roundoff 2^-8), then
    y = g + b is rounded to bf16 again, so |y_bf16 - y_32| <= 2^-8 |g| + 2^-8 |y| (+ 2^-16 terms),
    plus the two paths' float32 accumulation-order differences (twice bound 1).
    """
    x, w, b, dy = inputs(seed=6)
    x_leaf, w_leaf = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8_linear(x_leaf, w_leaf, b, name)
    assert y.dtype == torch.bfloat16
    y.backward(dy.bfloat16())
    assert x_leaf.grad.dtype == torch.float32 and w_leaf.grad.dtype == torch.float32
    y32 = fp8_linear(x, w, b, name).double()
    (_, y_tol, _), _, _ = recipe_bounds(x, w, dy, get_recipe(name))
    gemm = y32 - b.double()
    bound = (2.0**-8 + 2.0**-16) * (gemm.abs() + y32.abs()) + 2 * y_tol
    assert_within(y.detach(), y32, bound, "bf16 y")


def test_hybrid_quantizes_gradients_to_e5m2(monkeypatch):
    calls = []

    def spy(t, fmt="e4m3", granularity="tensor", *args, **kwargs):
        calls.append((fmt, granularity, tuple(t.shape)))
        return quantize(t, fmt, granularity, *args, **kwargs)

    monkeypatch.setattr(linear_module, "quantize", spy)
    x, w, _, dy = inputs(seed=7)
    w = w * 1.0  # a fresh tensor: nothing cached
    for fmt, gradient_format in [("hybrid", "e5m2"), ("e4m3", "e4m3")]:
        calls.clear()
        run_linear(x, w, None, dy, get_recipe("blockwise", fmt=fmt))
        dy_formats = {f for f, _, shape in calls if shape == (M, N)}
        other_formats = {f for f, _, shape in calls if shape != (M, N)}
        assert dy_formats == {gradient_format} and other_formats == {"e4m3"}, calls


# ---------------------------------------------------------------- delayed scaling


def delayed(**overrides):
    return get_recipe("tensorwise", scaling="delayed", **overrides)


def test_delayed_scaling_first_step_uses_scale_one_then_the_history():
    recipe, state = delayed(amax_history_len=3), DelayedScalingState(history_len=3)
    x, w, _, dy = inputs(seed=8)
    y1, _, _, _ = run_linear(x, w, None, dy, recipe, state)
    unit = torch.tensor(448.0)  # amax = fmt_max <=> scale 1, TE's initial scale
    ref1, tol1, _ = gemm_bounds(
        operand(x, "tensor", "e4m3", False, amax=unit), operand(w, "tensor", "e4m3", False, amax=unit), K
    )
    assert_within(y1, ref1, tol1, "step 1")
    assert state.histories["x"][0] == x.abs().max() and state.histories["w"][0] == w.abs().max()
    assert state.histories["dy"][0] == dy.abs().max()

    x2 = x * 0.25  # step 2 scales x with the history (step 1's amax), not its own
    y2, _, _, _ = run_linear(x2, w, None, dy, recipe, state)
    ref2, tol2, _ = gemm_bounds(
        operand(x2, "tensor", "e4m3", False, amax=x.abs().max()),
        operand(w, "tensor", "e4m3", False, amax=w.abs().max()),
        K,
    )
    assert_within(y2, ref2, tol2, "step 2")
    assert torch.equal(state.histories["x"][:2], torch.stack([x2.abs().max(), x.abs().max()]))


def test_delayed_scaling_saturates_values_beyond_the_history_amax():
    recipe, state = delayed(), DelayedScalingState()
    x, w, _, dy = inputs(seed=9)
    run_linear(x, w, None, dy, recipe, state)
    x_big = x * 4
    q = linear_module._quantize_operand(x_big, "tensor", "e4m3", recipe, state, "x")
    assert q.scale == x.abs().max() / 448.0
    assert q.dequantize().abs().max() == 448.0 * q.scale  # the largest values clipped to fmt_max * scale
    assert bool((q.data.float().abs() == 448.0).sum() > 1)


def test_delayed_scaling_window_algo_and_margin():
    state = DelayedScalingState(history_len=2)
    for amax in (8.0, 1.0, 2.0):
        state.record("x", torch.tensor(amax))
    assert float(state.scaling_amax("x", "max")) == 2.0  # 8.0 left the 2-step window
    assert float(state.scaling_amax("x", "most_recent")) == 2.0
    state.record("x", torch.tensor(1.0))
    assert float(state.scaling_amax("x", "max")) == 2.0 and float(state.scaling_amax("x", "most_recent")) == 1.0

    x = torch.randn(4, 64)
    for margin in (0, 1, 3):
        recipe = delayed(amax_history_len=2, margin=margin)
        q = linear_module._quantize_operand(
            x, "tensor", "e4m3", recipe, DelayedScalingState(2, {"x": torch.ones(2)}), "x"
        )
        assert q.scale == torch.tensor(2.0**margin) / 448.0


def test_delayed_scaling_state_round_trips():
    recipe = delayed(amax_history_len=4)
    x, w, _, dy = inputs(seed=10)
    state = DelayedScalingState(history_len=4)
    run_linear(x, w, None, dy, recipe, state)
    saved = state.state_dict()
    y_a = run_linear(x * 3, w, None, dy, recipe, state)
    restored = DelayedScalingState()
    restored.load_state_dict(saved)
    y_b = run_linear(x * 3, w, None, dy, recipe, restored)
    for a, b in zip(y_a, y_b, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_delayed_scaling_dgrad_uses_the_forward_fp8_weight():
    """TE reuses the delayed-scaled FP8 weight (transposed) for dgrad; a current-scaled W is wrong here."""
    recipe, state = delayed(), DelayedScalingState()
    x, w, _, dy = inputs(seed=11)
    # The history says W was 3x larger: its scale is 3x the current one (not a power of two, which
    # FP8 rounding would commute with, making the two weights indistinguishable).
    state.record("w", 3 * w.abs().max())
    state.record("dy", dy.abs().max())
    _, dx, _, _ = run_linear(x, w, None, dy, recipe, state)
    ref, tol, _ = gemm_bounds(
        operand(dy, "tensor", recipe.backward_format, False, amax=dy.abs().max()),
        transposed(operand(w, "tensor", "e4m3", False, amax=3 * w.abs().max())),
        N,
    )
    assert_within(dx, ref, tol, "dx")


def test_nonfinite_input_raises_and_leaves_the_history_untouched():
    recipe, state = delayed(), DelayedScalingState()
    x, w, _, dy = inputs(seed=12)
    run_linear(x, w, None, dy, recipe, state)
    before = state.state_dict()
    x_bad = x.clone()
    x_bad[0, 0] = math.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        fp8_linear(x_bad, w, None, recipe, state)
    assert all(torch.equal(before["histories"][k], v) for k, v in state.histories.items())


# ---------------------------------------------------------------- the quantized-weight cache


def _adamw_fused(w):
    torch.optim.AdamW([w], lr=0.1, fused=True).step()


def _no_grad_add(w):
    with torch.no_grad():
        w.add_(0.5)


def _data_assign(w):
    w.data = w.data * 3


UPDATES = {
    "sgd": lambda w: torch.optim.SGD([w], lr=0.5).step(),
    "adam_foreach": lambda w: torch.optim.Adam([w], lr=0.1, foreach=True).step(),
    "adamw_fused": _adamw_fused,  # does not bump w._version on CPU
    "no_grad_add_": _no_grad_add,
    "data_copy_": lambda w: w.data.copy_(torch.randn_like(w)),  # vLLM-style weight sync
    "data_assign": _data_assign,
    "shard_view_data_copy_": lambda w: w.view(-1)[:100].data.copy_(torch.randn(100)),  # megatron dist-opt
}


@pytest.mark.parametrize("update", sorted(UPDATES))
@pytest.mark.parametrize("name", RECIPES)
def test_weight_cache_sees_every_in_place_update(update, name):
    x, w0, _, dy = inputs(seed=13)
    w = torch.nn.Parameter(w0.clone())
    y_before = fp8_linear(x, w, None, name)
    y_before.backward(dy)
    UPDATES[update](w)
    x_leaf = x.clone().requires_grad_()
    y_after = fp8_linear(x_leaf, w, None, name)
    y_after.backward(dy)
    fresh = w.detach().clone()  # a new tensor: quantized from scratch
    x_fresh = x.clone().requires_grad_()
    y_fresh = fp8_linear(x_fresh, fresh, None, name)
    y_fresh.backward(dy)
    assert not torch.equal(y_after, y_before)
    assert torch.equal(y_after, y_fresh)
    assert torch.equal(x_leaf.grad, x_fresh.grad)  # dgrad's W^T is refreshed too


def test_weight_cache_reuses_an_unchanged_weight(monkeypatch):
    calls = []

    def spy(t, *args, **kwargs):
        calls.append(tuple(t.shape))
        return quantize(t, *args, **kwargs)

    x, w, _, _ = inputs(seed=14)
    w = torch.nn.Parameter(w.clone())
    fp8_linear(x, w, None, "rowwise")
    monkeypatch.setattr(linear_module, "quantize", spy)
    fp8_linear(x, w, None, "rowwise")
    assert (N, K) not in calls and (M, K) in calls


def _quantize_spy(monkeypatch) -> list[tuple]:
    calls: list[tuple] = []

    def spy(t, fmt, granularity, *args, **kwargs):
        calls.append((tuple(t.shape), granularity))
        return quantize(t, fmt, granularity, *args, **kwargs)

    monkeypatch.setattr(linear_module, "quantize", spy)
    return calls


@pytest.mark.parametrize("name", RECIPES)
def test_a_forward_only_pass_gives_the_training_forward_without_the_columnwise_copy(name, monkeypatch):
    """Under no_grad (rollout, old log-probs, shadow passes) x's columnwise quantization for wgrad is skipped."""
    x, w, b, _ = inputs(seed=15)
    w = torch.nn.Parameter(w.clone())
    fp8_linear(x, w, b, name)  # quantize and cache the weight first
    calls = _quantize_spy(monkeypatch)
    y_train = fp8_linear(x, w, b, name)
    train_calls = list(calls)
    calls.clear()
    with torch.no_grad():
        y_eval = fp8_linear(x, w, b, name)
    assert torch.equal(y_eval, y_train.detach())
    act = get_recipe(name).activation_granularity
    assert calls == [((M, K), act)]
    if TRANSPOSED[act] != act:  # the training forward also quantized x columnwise
        assert ((M, K), TRANSPOSED[act]) in train_calls


@pytest.mark.parametrize("name", RECIPES)
def test_a_frozen_weight_gets_no_wgrad_and_the_same_dgrad(name):
    x, w, _, dy = inputs(seed=16)
    _, dx_full, _, _ = run_linear(x, w, None, dy, name)
    x_leaf = x.clone().requires_grad_()
    frozen = w.clone()  # requires_grad False
    fp8_linear(x_leaf, frozen, None, name).backward(dy)
    assert frozen.grad is None
    assert torch.equal(x_leaf.grad, dx_full)


def test_tensorwise_dgrad_reads_the_forward_weight_input_transposed():
    """W^T's GEMM input is a view of W's (the same FP8 values): no second widening of the weight."""
    x, w, _, dy = inputs(seed=17)
    w = torch.nn.Parameter(w.clone())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8_linear(x.requires_grad_(), w, None, "tensorwise")
    y.float().backward(dy)
    inputs_by_key = {k: v for k, v in linear_module._WEIGHT_CACHE.values(w).items() if len(k) == 3}
    forward = next(v for k, v in inputs_by_key.items() if not k[1])
    transposed = next(v for k, v in inputs_by_key.items() if k[1])
    assert forward.dtype == torch.bfloat16 and transposed.data_ptr() == forward.data_ptr()
    assert torch.equal(transposed, forward.t())


def test_tensorwise_bf16_output_is_the_float32_scaled_gemm_rounded_once():
    """The bf16 output scaling is one `torch.mul` by a 0-d float32 scale: it must equal scaling the bf16
    GEMM output in float32 and rounding once (not a multiply by the scale rounded to bf16)."""
    from fp8rl.quant.tensor import fp8_to_float

    x, w, _, _ = inputs(seed=18)
    x = x.bfloat16()
    qx, qw = quantize(x, "e4m3", "tensor"), quantize(w, "e4m3", "tensor")
    raw = fp8_to_float(qx.data, torch.bfloat16) @ fp8_to_float(qw.data, torch.bfloat16).t()
    expected = (raw.float() * (qx.scale * qw.scale)).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8_linear(x, w, None, "tensorwise")
    assert y.dtype == torch.bfloat16 and torch.equal(y, expected)
    assert not torch.equal(y, raw * (qx.scale * qw.scale).bfloat16())  # the scale rounded to bf16 differs


def test_fake_quantize_reference_helper_matches_quantize():
    """The references above dequantize with `operand`; it must agree with fake_quantize."""
    x = inputs(seed=15)[0]
    assert torch.equal(
        operand(x, "block_1x128", "e4m3", True)[0].float(), fake_quantize(x, "e4m3", "block_1x128", True)
    )
