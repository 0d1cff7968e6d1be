"""An independent bit-level reference for the OCP FP8 formats, in numpy float64 (no torch casts).

Rounding follows the definition, not an implementation: for |v| > 0 the exponent is
e = max(floor(log2 |v|), emin), the quantum (spacing of representable values there) is
2^(e - mantissa_bits), and the result is round-half-to-even(v / quantum) * quantum, saturated at
the format's max. Every step is exact in float64: v / quantum is a power-of-two scaling of a float32
value, and np.rint rounds half to even. Codes are assembled from sign, biased exponent and mantissa
fields; `decode` is the OCP spec's formula.

Quantization (`ref_quantize`) follows the fp8rl convention from the issue, computed in numpy float32
(IEEE division, independent of torch): per block ``scale = amax / fmt_max`` (an underflow to 0 of a
nonzero block becomes the smallest float32; rounded up to a power of two when asked, clamped to
[2^-127, 2^127] for E8M0), an all-zero block gets scale 1, ``data = RNE(clamp(x / scale))``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RefFormat:
    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float
    has_inf: bool  # E5M2: IEEE-like (Inf and NaNs at exponent all-ones); E4M3 "fn": only S.1111.111 is NaN

    @property
    def emin(self) -> int:
        return 1 - self.bias


REF_FORMATS = {
    "e4m3": RefFormat("e4m3", 4, 3, 7, 448.0, has_inf=False),
    "e5m2": RefFormat("e5m2", 5, 2, 15, 57344.0, has_inf=True),
}

# Block shapes as the issue defines them, written out again here (not imported from fp8rl).
REF_BLOCKS = {
    "tensor": (None, None),
    "row": (1, None),
    "col": (None, 1),
    "block_1x128": (1, 128),
    "block_128x1": (128, 1),
    "block_128x128": (128, 128),
    "mx_1x32": (1, 32),
    "mx_32x1": (32, 1),
}
REF_E8M0 = {"mx_1x32", "mx_32x1"}


def decode(code: int, fmt: RefFormat) -> float:
    """The value of one FP8 bit pattern (0..255), by the spec's formula."""
    sign = -1.0 if code >> 7 else 1.0
    exponent = (code >> fmt.mantissa_bits) & ((1 << fmt.exponent_bits) - 1)
    mantissa = code & ((1 << fmt.mantissa_bits) - 1)
    all_ones = (1 << fmt.exponent_bits) - 1
    if fmt.has_inf and exponent == all_ones:
        return sign * math.inf if mantissa == 0 else math.nan
    if not fmt.has_inf and exponent == all_ones and mantissa == (1 << fmt.mantissa_bits) - 1:
        return math.nan
    if exponent == 0:
        return sign * mantissa * 2.0 ** (fmt.emin - fmt.mantissa_bits)
    return sign * (1 + mantissa / 2**fmt.mantissa_bits) * 2.0 ** (exponent - fmt.bias)


def round_to_fp8(values: np.ndarray, fmt: RefFormat) -> np.ndarray:
    """Saturating round-half-to-even of finite float64 values onto the FP8 grid (float64 out, signs kept)."""
    v = np.asarray(values, dtype=np.float64)
    magnitude = np.abs(v)
    _, frexp_exponent = np.frexp(magnitude)  # magnitude = m * 2^frexp_exponent, m in [0.5, 1)
    exponent = np.maximum(frexp_exponent - 1, fmt.emin)
    quantum = np.ldexp(1.0, exponent - fmt.mantissa_bits)
    rounded = np.minimum(np.rint(magnitude / quantum) * quantum, fmt.max)
    rounded = np.where(magnitude == 0, 0.0, rounded)
    return np.copysign(rounded, v)


def encode(values: np.ndarray, fmt: RefFormat) -> np.ndarray:
    """Bit patterns (uint8) of values already on the FP8 grid (finite)."""
    v = np.asarray(values, dtype=np.float64)
    sign = np.signbit(v).astype(np.int64)
    magnitude = np.abs(v)
    _, frexp_exponent = np.frexp(magnitude)
    biased = np.where(magnitude == 0, 0, np.maximum(frexp_exponent - 1 + fmt.bias, 0))
    normal = biased > 0
    significand = np.where(normal, magnitude / np.ldexp(1.0, biased - fmt.bias) - 1.0, 0.0)
    mantissa = np.where(normal, significand * 2**fmt.mantissa_bits, magnitude / 2.0 ** (fmt.emin - fmt.mantissa_bits))
    assert np.all(mantissa == np.round(mantissa)), "encode() needs values on the FP8 grid"
    return ((sign << 7) | (biased << fmt.mantissa_bits) | mantissa.astype(np.int64)).astype(np.uint8)


def ref_block_scales(amax: np.ndarray, fmt: RefFormat, pow2: bool, e8m0: bool) -> np.ndarray:
    """float32 scales from float32 block amaxes."""
    amax = np.asarray(amax, dtype=np.float32)
    scale = (amax / np.float32(fmt.max)).astype(np.float32)
    scale = np.where((scale == 0) & (amax > 0), np.float32(2.0**-149), scale).astype(np.float32)
    if pow2:
        mantissa, exponent = np.frexp(scale.astype(np.float64))
        rounded_up = np.ldexp(1.0, np.where(mantissa == 0.5, exponent - 1, exponent))
        scale = np.where(scale > 0, rounded_up, scale).astype(np.float32)
    if e8m0:
        scale = np.where(scale > 0, np.clip(scale, np.float32(2.0**-127), np.float32(2.0**127)), scale)
    return np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)


def ref_quantize(x: np.ndarray, fmt_name: str, granularity: str, pow2: bool) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 shaped like x, float32 scales shaped (R/br, C/bc) rounded up, or 0-d) of a 2-D float32 x."""
    fmt = REF_FORMATS[fmt_name]
    x = np.asarray(x, dtype=np.float32)
    rows, cols = x.shape
    block_rows, block_cols = REF_BLOCKS[granularity]
    block_rows = block_rows or max(rows, 1)
    block_cols = block_cols or max(cols, 1)
    n_row_blocks, n_col_blocks = -(-rows // block_rows), -(-cols // block_cols)
    # Per-block amax over the elements that exist: a partial last block is padded with zeros,
    # which cannot raise an amax.
    padded = np.zeros((n_row_blocks * block_rows, n_col_blocks * block_cols), dtype=np.float32)
    padded[:rows, :cols] = np.abs(x)
    amax = padded.reshape(n_row_blocks, block_rows, n_col_blocks, block_cols).max(axis=(1, 3))
    e8m0 = granularity in REF_E8M0
    scales = ref_block_scales(amax, fmt, pow2 or e8m0, e8m0)
    per_element = np.repeat(np.repeat(scales, block_rows, axis=0), block_cols, axis=1)[:rows, :cols]
    scaled = (x / per_element).astype(np.float32)  # IEEE float32 division, as the convention says
    codes = encode(round_to_fp8(scaled, fmt), fmt)
    return codes, scales.reshape(()) if granularity == "tensor" else scales


def fp8_grid(fmt: RefFormat) -> np.ndarray:
    """All finite non-negative FP8 values, ascending (float64)."""
    values = {decode(code, fmt) for code in range(128)}
    return np.array(sorted(v for v in values if math.isfinite(v)))
