"""quantize / dequantize / fake_quantize: shapes, error bounds, partial blocks, zeros, non-finite inputs, pow2.

Error bound used throughout (one element x of a block with scale s, format with m mantissa bits and
smallest normal exponent emin, unit roundoff u = 2^-(m+1): 2^-4 for E4M3, 2^-3 for E5M2):

    x / s in the normal range:     |x_hat - x| <= u |x|                (round to nearest, relative)
    x / s in the subnormal range:  |x_hat - x| <= s * 2^(emin - m - 1) (half the subnormal spacing)

plus 2^-22 |x| for the two float32 roundings of a non-power-of-two scale (x / s before the cast,
q * s in dequantize); with a power-of-two scale both are exact. Current scaling never saturates
beyond that: amax / s = fmt_max up to one float32 rounding.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8rl.quant import E4M3, GRANULARITIES, dequantize, fake_quantize, get_format, quantize
from fp8rl.quant.tensor import expand_scale, fp8_to_float

FMTS = ("e4m3", "e5m2")
MAIN_GRANULARITIES = ("tensor", "row", "block_1x128", "block_128x128", "mx_1x32")


def expected_scale_shape(granularity: str, rows: int, cols: int) -> tuple[int, ...]:
    blocks = {
        "tensor": None,
        "row": (1, cols),
        "col": (rows, 1),
        "block_1x128": (1, 128),
        "block_128x1": (128, 1),
        "block_128x128": (128, 128),
        "mx_1x32": (1, 32),
        "mx_32x1": (32, 1),
    }[granularity]
    if blocks is None:
        return ()
    return (math.ceil(rows / blocks[0]), math.ceil(cols / blocks[1]))


def error_bound(x: torch.Tensor, q, pow2: bool) -> torch.Tensor:
    """The per-element bound from the module docstring, in float64."""
    fmt = get_format(q.fmt)
    unit_roundoff = 2.0 ** -(fmt.mantissa_bits + 1)
    x2d = x.double().reshape(-1, x.shape[-1]) if x.dim() > 1 else x.double().reshape(1, -1)
    scale = expand_scale(q.scale, q.granularity, x2d.shape).double()
    float32_slack = 0.0 if pow2 else 2.0**-22
    subnormal_half_spacing = scale * 2.0 ** (1 - fmt.exponent_bias - fmt.mantissa_bits - 1)
    return ((unit_roundoff + float32_slack) * x2d.abs() + subnormal_half_spacing).reshape(x.shape)


def llm_like(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Gaussian values, 100x outlier channels, per-row magnitudes over 2^+-8, a zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.empty(rows, 1).uniform_(-8, 8, generator=g))
    x[:, torch.randperm(cols, generator=g)[:3]] *= 100
    x[rows // 2] = 0
    return x


# ---------------------------------------------------------------- shapes and dtypes


@pytest.mark.parametrize("granularity", sorted(GRANULARITIES))
@pytest.mark.parametrize("shape", [(256, 384), (130, 200), (1, 7), (33, 1)])
@pytest.mark.parametrize("fmt", FMTS)
def test_data_and_scale_shapes(granularity, shape, fmt):
    x = torch.randn(shape)
    q = quantize(x, fmt, granularity)
    assert q.data.shape == x.shape and q.data.dtype == get_format(fmt).dtype
    assert q.scale.dtype == torch.float32
    assert tuple(q.scale.shape) == expected_scale_shape(granularity, *shape)
    assert q.fmt == fmt and q.granularity == granularity and q.orig_dtype == torch.float32


def test_leading_dimensions_flatten_into_rows():
    x = torch.randn(2, 3, 160)
    q = quantize(x, "e4m3", "block_1x128")
    assert q.data.shape == x.shape and tuple(q.scale.shape) == (6, 2)
    flat = quantize(x.reshape(6, 160), "e4m3", "block_1x128")
    assert torch.equal(q.data.view(torch.uint8).reshape(6, 160), flat.data.view(torch.uint8))
    assert torch.equal(q.scale, flat.scale)
    assert q.dequantize().shape == x.shape


def test_empty_tensors_quantize_to_empty_tensors():
    for granularity in MAIN_GRANULARITIES:
        q = quantize(torch.zeros(0, 5), "e4m3", granularity)
        assert q.data.shape == (0, 5) and q.dequantize().shape == (0, 5)
        assert tuple(q.scale.shape) == expected_scale_shape(granularity, 0, 5)


# ---------------------------------------------------------------- accuracy


@pytest.mark.parametrize("granularity", sorted(GRANULARITIES))
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("pow2", [False, True])
def test_dequantize_error_is_within_the_derived_bound(granularity, fmt, pow2):
    x = llm_like(150, 300, seed=len(granularity))
    q = quantize(x, fmt, granularity, pow2)
    err = (q.dequantize().double() - x.double()).abs()
    bound = error_bound(x, q, pow2=pow2 or granularity.startswith("mx"))
    assert bool((err <= bound).all()), float((err - bound).max())


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=2.0**-6, max_value=448.0, width=32), st.booleans())
def test_normal_range_e4m3_relative_error_at_most_2_to_minus_4(magnitude, negative):
    value = -magnitude if negative else magnitude
    x = torch.tensor([value])
    x_hat = fake_quantize(x, "e4m3", amax=torch.tensor(448.0))  # scale exactly 1
    assert abs(x_hat.item() - value) <= 2.0**-4 * abs(value)


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=2.0**-14, max_value=57344.0, width=32))
def test_normal_range_e5m2_relative_error_at_most_2_to_minus_3(value):
    x_hat = fake_quantize(torch.tensor([value]), "e5m2", amax=torch.tensor(57344.0))
    assert abs(x_hat.item() - value) <= 2.0**-3 * value


@settings(max_examples=60, deadline=None)
@given(
    fmt=st.sampled_from(FMTS),
    granularity=st.sampled_from(sorted(GRANULARITIES)),
    pow2=st.booleans(),
    rows=st.integers(1, 70),
    cols=st.integers(1, 300),
    seed=st.integers(0, 2**31 - 1),
    log2_scale=st.integers(-60, 60),
)
def test_error_bound_holds_for_any_shape_and_magnitude(fmt, granularity, pow2, rows, cols, seed, log2_scale):
    x = llm_like(rows, cols, seed) * 2.0**log2_scale
    q = quantize(x, fmt, granularity, pow2)
    err = (q.dequantize().double() - x.double()).abs()
    assert bool((err <= error_bound(x, q, pow2=pow2 or granularity.startswith("mx"))).all())


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 400), seed=st.integers(0, 2**31 - 1), fmt=st.sampled_from(FMTS))
def test_finer_nested_blocks_never_increase_an_elements_error_with_pow2_scales(rows, cols, seed, fmt):
    """tensor > row > 1x128 > 1x32 are nested groups, so their power-of-two scales are non-increasing.

    FP8 rounding commutes with power-of-two scaling in the normal range, and a smaller power-of-two
    scale refines the subnormal grid, so every element's error is at most its coarser-grouped error.
    """
    x = llm_like(rows, cols, seed)
    errors = [
        (fake_quantize(x, fmt, g, pow2_scale=True).double() - x.double()).abs()
        for g in ("tensor", "row", "block_1x128", "mx_1x32")
    ]
    for coarse, fine in zip(errors, errors[1:], strict=False):
        assert bool((fine <= coarse).all())


# ---------------------------------------------------------------- partial blocks and zeros


@pytest.mark.parametrize("granularity", ["block_1x128", "block_128x128", "mx_1x32", "block_128x1", "mx_32x1"])
def test_partial_last_blocks_use_their_own_elements(granularity):
    """A 130 x 200 tensor whose partial edge blocks hold much smaller values than the full blocks."""
    x = torch.randn(130, 200) * 1000
    x[128:, :] = torch.randn(2, 200) * 1e-3
    x[:, 192:] = torch.randn(130, 8) * 1e-3
    q = quantize(x, "e4m3", granularity)
    scale = expand_scale(q.scale, granularity, x.shape)
    # Expected scale of each element's block, from slicing the block out explicitly.
    block_rows, block_cols = GRANULARITIES[granularity]
    for r0 in range(0, 130, block_rows):
        for c0 in range(0, 200, block_cols):
            block = x[r0 : r0 + block_rows, c0 : c0 + block_cols]
            expected = block.abs().max() / 448.0
            if granularity.startswith("mx"):  # E8M0: the next power of two up
                mantissa, exponent = math.frexp(float(expected))
                expected = torch.tensor(2.0 ** (exponent - 1 if mantissa == 0.5 else exponent))
            assert scale[r0, c0] == expected, (r0, c0)
    assert bool(((q.dequantize() - x).abs() <= error_bound(x, q, pow2=granularity.startswith("mx"))).all())


@pytest.mark.parametrize("granularity", sorted(GRANULARITIES))
@pytest.mark.parametrize("fmt", FMTS)
def test_all_zero_input_dequantizes_to_exact_zeros(granularity, fmt):
    q = quantize(torch.zeros(70, 150), fmt, granularity)
    assert bool((q.scale == 1).all())
    assert bool((q.data.view(torch.uint8) == 0).all())
    assert torch.equal(q.dequantize(), torch.zeros(70, 150))


def test_a_zero_block_next_to_nonzero_blocks_is_exact():
    x = torch.randn(4, 256)
    x[:, 128:] = 0
    q = quantize(x, "e4m3", "block_1x128")
    assert bool((q.scale[:, 1] == 1).all())
    assert bool((q.dequantize()[:, 128:] == 0).all())


@pytest.mark.parametrize("pow2", [False, True])
def test_tiny_nonzero_block_is_not_flushed_to_zero(pow2):
    """amax / 448 underflows float32 here; the block must still dequantize to its (exact) values."""
    x = torch.tensor([[7 * 2.0**-149, -(2.0**-147)]])  # float32 subnormals, 7 and 4 times the smallest
    q = quantize(x, "e4m3", "row", pow2)
    assert q.scale.item() == 2.0**-149
    assert torch.equal(q.dequantize(), x)


# ---------------------------------------------------------------- non-finite inputs


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("granularity", MAIN_GRANULARITIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nonfinite_input_raises_by_default(bad, granularity, dtype):
    x = torch.randn(8, 160, dtype=dtype)
    x[3, 77] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(x, "e4m3", granularity)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_input_raises_with_a_given_amax(bad):
    """Delayed scaling passes the amax: the check must still look at x (a NaN became 480.0 before)."""
    x = torch.randn(4, 16)
    x[1, 2] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(x, "e4m3", "tensor", amax=torch.tensor(10.0))


def test_nonfinite_given_amax_raises():
    with pytest.raises(ValueError, match="amax"):
        quantize(torch.randn(4, 4), "e4m3", amax=torch.tensor(math.inf))


@pytest.mark.parametrize("granularity", MAIN_GRANULARITIES)
@pytest.mark.parametrize("fmt", FMTS)
def test_propagate_writes_nan_and_scales_from_the_finite_values(granularity, fmt):
    x = torch.randn(6, 256)
    x[0, 5], x[2, 200], x[5, 40] = math.nan, math.inf, -math.inf
    q = quantize(x, fmt, granularity, nonfinite="propagate")
    bad = ~torch.isfinite(x)
    out = q.dequantize()
    assert torch.equal(torch.isnan(out), bad)
    clean = quantize(torch.where(bad, torch.zeros_like(x), x), fmt, granularity)
    assert torch.equal(q.scale, clean.scale)
    assert torch.equal(out[~bad], clean.dequantize()[~bad])


# ---------------------------------------------------------------- power-of-two and E8M0 scales


def _is_pow2(t: torch.Tensor) -> bool:
    mantissa, _ = torch.frexp(t)
    return bool((mantissa == 0.5).all())


@pytest.mark.parametrize("granularity", MAIN_GRANULARITIES)
@pytest.mark.parametrize("fmt", FMTS)
def test_pow2_scales_are_the_next_power_of_two_up(granularity, fmt):
    x = llm_like(140, 260, seed=1)
    exact = quantize(x, fmt, granularity).scale
    pow2 = quantize(x, fmt, granularity, pow2_scale=True).scale
    assert _is_pow2(pow2)
    assert bool((pow2 >= exact).all()) and bool((pow2 < 2 * exact).all())


def test_mx_scales_are_always_pow2_and_clamped_to_e8m0():
    x = torch.randn(2, 64)
    x[1] *= 1e-40  # amax / 448 far below 2^-127: E8M0 cannot go lower
    q = quantize(x, "e4m3", "mx_1x32", pow2_scale=False)
    assert _is_pow2(q.scale)
    assert bool((q.scale[1] == 2.0**-127).all())
    amax = x.abs().reshape(2, 2, 32).amax(-1)
    assert bool((amax / q.scale <= E4M3.max).all())  # no saturation of the block maximum


# ---------------------------------------------------------------- dequantize / fake_quantize / transpose


@pytest.mark.parametrize("pow2", [False, True])
def test_dequantize_dtypes(pow2):
    x = torch.randn(16, 256).bfloat16()
    q = quantize(x, "e4m3", "block_1x128", pow2)
    assert q.orig_dtype == torch.bfloat16 and q.dequantize().dtype == torch.bfloat16
    assert dequantize(q, torch.float32).dtype == torch.float32
    # bf16 output is the float32 value rounded once to bf16, whichever path computed it
    assert torch.equal(q.dequantize(torch.bfloat16), q.dequantize(torch.float32).bfloat16())


@pytest.mark.parametrize("granularity", MAIN_GRANULARITIES)
def test_fake_quantize_is_quantize_then_dequantize(granularity):
    x = torch.randn(3, 40, 130)
    out = fake_quantize(x, "e5m2", granularity, True)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(out, quantize(x, "e5m2", granularity, True).dequantize())


@pytest.mark.parametrize("granularity", sorted(GRANULARITIES))
def test_transpose_is_a_view_with_the_transposed_granularity(granularity):
    x = torch.randn(70, 150)
    q = quantize(x, "e4m3", granularity)
    qt = q.t()
    assert torch.equal(qt.dequantize(), q.dequantize().t())
    assert qt.data.data_ptr() == q.data.data_ptr()


def test_fp8_to_float_is_exact_in_flush_to_zero_mode():
    """FP8 subnormals decode through float32 subnormals; flush-denormal mode must not zero them."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    expected = fp8_to_float(codes)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode")
    try:
        got = fp8_to_float(codes)
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(torch.isnan(got), torch.isnan(expected))
    assert torch.equal(got.nan_to_num(), expected.nan_to_num())
    assert float(got[1]) == 2.0**-9


# ---------------------------------------------------------------- argument checking


def test_invalid_arguments_raise_with_the_valid_choices():
    x = torch.randn(4, 4)
    with pytest.raises(ValueError, match="valid granularities"):
        quantize(x, "e4m3", "block_64x64")
    with pytest.raises(ValueError, match="valid formats"):
        quantize(x, "e2m1")
    with pytest.raises(ValueError, match="valid modes"):
        quantize(x, nonfinite="ignore")
    with pytest.raises(TypeError):
        quantize(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(TypeError):
        quantize(x.to(torch.float8_e4m3fn))


# ---------------------------------------------------------------- the compiled fast path


@pytest.mark.slow
def test_compiled_quantize_is_bit_identical_to_eager():
    """compile=True runs the same per-element ops through inductor; data bytes and scales must not change.

    Partial blocks in both dimensions and a single row: inductor miscompiled formulations of both
    (see `fp8rl.quant.tensor._quantize_2d`). Three graphs only: each compile takes seconds on this CPU.
    """
    x = llm_like(130, 300, seed=5)
    x[7, 9] = 1e-40  # a float32 subnormal input
    cases = [(x, "e4m3", "tensor", False), (x, "e5m2", "block_1x128", True), (x[:1, :200], "e4m3", "mx_1x32", False)]
    for t, fmt, granularity, pow2 in cases:
        eager = quantize(t, fmt, granularity, pow2)
        compiled = quantize(t, fmt, granularity, pow2, compile=True)
        assert torch.equal(compiled.scale, eager.scale), (fmt, granularity)
        assert torch.equal(compiled.data.view(torch.uint8), eager.data.view(torch.uint8)), (fmt, granularity)
    bad = x.clone()
    bad[0, 0] = math.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(bad, "e4m3", "tensor", compile=True)  # the graph compiled above, no recompilation


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("granularity", ["tensor", "row", "block_1x128", "mx_1x32"])
def test_quantize_never_writes_to_its_input(granularity, dtype):
    """The eager path divides its own float32 copy in place; the caller's tensor must stay as it was."""
    x = llm_like(37, 300, seed=5).to(dtype)
    before = x.clone()
    quantize(x, "e4m3", granularity)
    if granularity == "tensor":
        quantize(x, "e4m3", granularity, amax=torch.tensor(1.0))  # delayed scaling: saturates
    assert torch.equal(x, before)
