"""The emulator's FP8 casts and decodes against the independent bit-level reference (fp8_reference.py).

Every comparison here is of raw bits: FP8 codes (``data.view(uint8)``) and float32 scales must be
identical, not merely close. The reference never calls torch's FP8 cast.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8rl.quant import quantize
from fp8rl.quant.tensor import fp8_to_float

from .fp8_reference import REF_BLOCKS, REF_FORMATS, decode, encode, fp8_grid, ref_quantize, round_to_fp8

DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FMTS = ("e4m3", "e5m2")


def codes_of(q) -> np.ndarray:
    return q.data.contiguous().view(torch.uint8).numpy()


def cast_with_unit_scale(values: np.ndarray, fmt: str) -> np.ndarray:
    """The emulator's saturate-and-cast on its own: an amax of fmt_max makes every scale exactly 1."""
    x = torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(1, -1))
    q = quantize(x, fmt, "tensor", amax=torch.tensor(REF_FORMATS[fmt].max))
    assert q.scale.item() == 1.0
    return codes_of(q).reshape(-1)


# ---------------------------------------------------------------- decoding all 256 bit patterns


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("target", [torch.float32, torch.bfloat16])
def test_fp8_to_float_decodes_every_bit_pattern_like_the_spec(fmt, target):
    codes = torch.arange(256, dtype=torch.uint8)
    got = fp8_to_float(codes.view(DTYPES[fmt]), target).double().numpy()
    expected = np.array([decode(c, REF_FORMATS[fmt]) for c in range(256)])
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan], expected[~nan])
    assert np.array_equal(np.signbit(got[~nan]), np.signbit(expected[~nan]))  # -0.0 stays -0.0


@pytest.mark.parametrize("fmt", FMTS)
def test_fp8_to_float_without_nonfinite_check_is_exact_on_finite_codes(fmt):
    expected = np.array([decode(c, REF_FORMATS[fmt]) for c in range(256)])
    finite = np.flatnonzero(np.isfinite(expected))
    codes = torch.tensor(finite, dtype=torch.uint8).view(DTYPES[fmt])
    got = fp8_to_float(codes, torch.float32, check_nonfinite=False).double().numpy()
    assert np.array_equal(got, expected[finite])


def test_spec_constants_from_the_decoder():
    """The decoder reproduces the formats' published extremes (a check of the reference itself)."""
    e4m3, e5m2 = REF_FORMATS["e4m3"], REF_FORMATS["e5m2"]
    assert fp8_grid(e4m3)[-1] == 448.0 and fp8_grid(e4m3)[1] == 2.0**-9
    assert fp8_grid(e5m2)[-1] == 57344.0 and fp8_grid(e5m2)[1] == 2.0**-16
    assert len(fp8_grid(e4m3)) == 127 and len(fp8_grid(e5m2)) == 124  # 126 / 123 nonzero magnitudes + 0
    assert decode(0x7F, e4m3) != decode(0x7F, e4m3)  # NaN
    assert decode(0x7C, e5m2) == math.inf and math.isnan(decode(0x7D, e5m2))


# ---------------------------------------------------------------- the cast, value by value


# (input, expected value) written out by hand from the format definitions: ties to even, saturation,
# subnormals, signed zero.
HAND_CASES = {
    "e4m3": [
        (1.0625, 1.0),  # tie between 1.0 (mantissa 000) and 1.125 (001): even is 1.0
        (1.1875, 1.25),  # tie between 1.125 (001) and 1.25 (010): even is 1.25
        (1.0625 + 2**-20, 1.125),  # just above the tie
        (448.0, 448.0),
        (464.0, 448.0),  # the tie with 480 would round up past max: saturated
        (1e6, 448.0),
        (-1e30, -448.0),
        (2.0**-9, 2.0**-9),  # smallest subnormal
        (2.0**-10, 0.0),  # tie between 0 and 2^-9: even is 0
        (3 * 2.0**-11, 2.0**-9),
        (3 * 2.0**-10, 2 * 2.0**-9),  # tie between 1 and 2 quanta: even is 2
        (2.0**-6 - 2.0**-10, 2.0**-6),  # rounds up from the subnormals into the first normal
        (-0.0, -0.0),
        (-(2.0**-11), -0.0),  # underflows to a zero that keeps its sign
    ],
    "e5m2": [
        (1.125, 1.0),  # tie between 1.0 (00) and 1.25 (01)
        (1.375, 1.5),  # tie between 1.25 (01) and 1.5 (10)
        (57344.0, 57344.0),
        (61440.0, 57344.0),  # the tie with 65536 (Inf in E5M2): saturated
        (1e9, 57344.0),
        (2.0**-16, 2.0**-16),
        (2.0**-17, 0.0),
        (3 * 2.0**-17, 2 * 2.0**-16),
        (-0.0, -0.0),
    ],
}


@pytest.mark.parametrize("fmt", FMTS)
def test_hand_computed_roundings(fmt):
    inputs = np.array([v for v, _ in HAND_CASES[fmt]])
    expected = np.array([e for _, e in HAND_CASES[fmt]])
    reference = round_to_fp8(inputs, REF_FORMATS[fmt])
    assert np.array_equal(reference, expected) and np.array_equal(np.signbit(reference), np.signbit(expected))
    assert np.array_equal(cast_with_unit_scale(inputs, fmt), encode(expected, REF_FORMATS[fmt]))


@pytest.mark.parametrize("fmt", FMTS)
def test_every_tie_and_its_neighbours_round_like_the_reference(fmt):
    """All midpoints between consecutive FP8 values (exact in float32), +-1 float32 ulp, both signs."""
    grid = fp8_grid(REF_FORMATS[fmt])
    mids = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
    values = np.concatenate(
        [grid.astype(np.float32), mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0))]
    )
    values = np.concatenate([values, -values])
    expected = encode(round_to_fp8(values.astype(np.float64), REF_FORMATS[fmt]), REF_FORMATS[fmt])
    assert np.array_equal(cast_with_unit_scale(values, fmt), expected)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_magnitudes_subnormals_and_overflow_round_like_the_reference(fmt, seed):
    """Log-uniform magnitudes over 2^-160 .. 2^40 (float32 subnormals, FP8 subnormals, normals, past max)."""
    rng = np.random.default_rng(seed)
    values = (rng.choice([-1.0, 1.0], 20_000) * np.exp2(rng.uniform(-160, 40, 20_000))).astype(np.float32)
    values[::97] = 0.0
    expected = encode(round_to_fp8(values.astype(np.float64), REF_FORMATS[fmt]), REF_FORMATS[fmt])
    assert np.array_equal(cast_with_unit_scale(values, fmt), expected)


@pytest.mark.parametrize("fmt", FMTS)
def test_bfloat16_inputs_round_like_the_reference(fmt):
    rng = np.random.default_rng(7)
    values = torch.from_numpy((rng.standard_normal(5000) * np.exp2(rng.uniform(-20, 20, 5000))).astype(np.float32))
    values = values.bfloat16()
    q = quantize(values.reshape(1, -1), fmt, "tensor", amax=torch.tensor(REF_FORMATS[fmt].max))
    expected = encode(round_to_fp8(values.double().numpy(), REF_FORMATS[fmt]), REF_FORMATS[fmt])
    assert np.array_equal(codes_of(q).reshape(-1), expected)


# ---------------------------------------------------------------- whole quantize(): scales and codes

SHAPES = [(1, 1), (3, 5), (7, 33), (2, 300), (129, 128), (130, 257), (64, 96)]


def _random_matrix(rng: np.random.Generator, shape: tuple[int, int], spread: float) -> np.ndarray:
    """Gaussian values times per-row and per-column magnitudes spanning 2^+-spread, some zero rows/blocks."""
    rows, cols = shape
    x = rng.standard_normal(shape) * np.exp2(rng.uniform(-spread, spread, (rows, 1)))
    x = x * np.exp2(rng.uniform(-spread / 2, spread / 2, (1, cols)))
    if rows > 2:
        x[1] = 0.0  # an all-zero row: every row-shaped block in it has scale 1
    if cols > 40:
        x[:, 32:40] = 0.0
    return x.astype(np.float32)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("granularity", sorted(REF_BLOCKS))
@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_matches_the_reference_bit_for_bit(fmt, granularity, pow2):
    rng = np.random.default_rng(zlib.crc32(f"{fmt}-{granularity}-{pow2}".encode()))
    for shape in SHAPES:
        x = _random_matrix(rng, shape, spread=12.0)
        q = quantize(torch.from_numpy(x), fmt, granularity, pow2)
        codes, scales = ref_quantize(x, fmt, granularity, pow2)
        assert q.scale.shape == scales.shape, (shape, q.scale.shape, scales.shape)
        assert np.array_equal(q.scale.numpy().view(np.uint32), scales.view(np.uint32)), shape
        assert np.array_equal(codes_of(q), codes), shape


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("granularity", ["row", "block_1x128", "mx_1x32"])
def test_power_of_two_scales_keep_planted_ties_exact(fmt, granularity):
    """With power-of-two scales x / scale is exact, so FP8 midpoints times 2^k stay ties after scaling."""
    grid = fp8_grid(REF_FORMATS[fmt])
    mids = (grid[1:] + grid[:-1]) / 2
    rng = np.random.default_rng(3)
    x = rng.choice(mids, size=(16, 256)) * rng.choice([-1, 1], size=(16, 256)) * np.exp2(rng.integers(-8, 8, (16, 1)))
    x = x.astype(np.float32)
    q = quantize(torch.from_numpy(x), fmt, granularity, pow2_scale=True)
    codes, scales = ref_quantize(x, fmt, granularity, pow2=True)
    assert np.array_equal(q.scale.numpy(), scales)
    assert np.array_equal(codes_of(q), codes)


def test_tiny_and_huge_blocks_match_the_reference():
    """Blocks whose amax / fmt_max underflows or nears float32's max, next to ordinary blocks."""
    x = np.zeros((4, 64), dtype=np.float32)
    x[0, :32] = np.float32(1e-44) * np.arange(1, 33)  # float32 subnormals: amax / 448 underflows
    x[0, 32:] = np.float32(3e38)
    x[1] = np.linspace(-1, 1, 64)
    x[2, :32] = np.float32(1e-40)
    for fmt in FMTS:
        for granularity, pow2 in [("mx_1x32", True), ("row", False), ("row", True), ("block_1x128", False)]:
            q = quantize(torch.from_numpy(x), fmt, granularity, pow2)
            codes, scales = ref_quantize(x, fmt, granularity, pow2)
            assert np.array_equal(q.scale.numpy(), scales), (fmt, granularity, pow2)
            assert np.array_equal(codes_of(q), codes), (fmt, granularity, pow2)


@settings(max_examples=40, deadline=None)
@given(
    fmt=st.sampled_from(FMTS),
    granularity=st.sampled_from(sorted(REF_BLOCKS)),
    pow2=st.booleans(),
    rows=st.integers(1, 140),
    cols=st.integers(1, 300),
    seed=st.integers(0, 2**32 - 1),
    spread=st.floats(0, 30),
)
def test_quantize_matches_the_reference_on_generated_shapes(fmt, granularity, pow2, rows, cols, seed, spread):
    x = _random_matrix(np.random.default_rng(seed), (rows, cols), spread)
    q = quantize(torch.from_numpy(x), fmt, granularity, pow2)
    codes, scales = ref_quantize(x, fmt, granularity, pow2)
    assert np.array_equal(q.scale.numpy(), scales)
    assert np.array_equal(codes_of(q), codes)


def ref_dequantize(codes: np.ndarray, scales: np.ndarray, fmt: str, granularity: str) -> np.ndarray:
    """``decode(code) * scale`` per element in float64, rounded once to float32 (the exact product)."""
    ref_fmt = REF_FORMATS[fmt]
    values = np.vectorize(lambda c: decode(int(c), ref_fmt))(codes).astype(np.float64)
    block_rows, block_cols = REF_BLOCKS[granularity]
    rows, cols = codes.shape
    block_rows, block_cols = block_rows or rows, block_cols or cols
    per_element = np.repeat(np.repeat(scales.reshape(-(-rows // block_rows), -1), block_rows, 0), block_cols, 1)
    return (values * per_element[:rows, :cols].astype(np.float64)).astype(np.float32)


@pytest.mark.parametrize("huge", [False, True])
@pytest.mark.parametrize("granularity", ["tensor", "row", "block_1x128", "mx_1x32"])
@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_matches_the_reference_for_tiny_ordinary_and_huge_scales(fmt, granularity, huge):
    """Dequantization multiplies bit-placed codes by ``scale * 2^k`` when that is finite for every
    block (ordinary and tiny scales), else (a scale near 2^119) multiplies twice: both must give
    ``decode(code) * scale`` rounded once."""
    x = np.zeros((4, 160), dtype=np.float32)
    x[0, :32] = np.float32(1e-44) * np.arange(1, 33)  # subnormal amax: subnormal or E8M0-clamped scales
    x[1] = np.linspace(-1, 1, 160)
    x[2, :32] = np.float32(1e-40)
    x[3] = np.float32(1e5) * np.linspace(-1, 1, 160)  # scale >= 2^8
    if huge:
        x[0, 32:] = np.float32(3e38)  # scale ~ 2^119: scale * 2^120 overflows
    for pow2 in (False, True):
        q = quantize(torch.from_numpy(x), fmt, granularity, pow2)
        expected = ref_dequantize(codes_of(q), q.scale.numpy(), fmt, granularity)
        assert np.array_equal(q.dequantize(torch.float32).numpy(), expected), (fmt, granularity, pow2)
