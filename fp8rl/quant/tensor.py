"""Quantize / dequantize a tensor to FP8 with per-block scales (pure torch).

Convention (the same for every granularity): ``x ~= data.float() * scale`` blockwise, with
``scale = amax(|block|) / fmt_max`` (rounded up to a power of two when ``pow2_scale`` is set, and
always for "mx_1x32"), values saturated to +-fmt_max before the cast, which rounds to nearest even.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fp8rl.quant.formats import Fp8Format, get_format
from fp8rl.quant.granularity import POW2_ONLY, TRANSPOSED, block_shape, check_granularity, scale_shape

NONFINITE_MODES = ("raise", "propagate")
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127
SMALLEST_FP32_SUBNORMAL = 2.0**-149
SMALLEST_FP32_NORMAL = 2.0**-126


@dataclass
class Fp8Tensor:
    """An FP8 tensor and its per-block scales.

    Attributes:
        data: FP8 values, same shape as the input (torch.float8_e4m3fn or torch.float8_e5m2).
        scale: float32, one value per block, shape (R, C) / block shape rounded up; 0-d for "tensor".
        fmt: the format name ("e4m3" or "e5m2").
        granularity: the granularity name the scales follow.
        orig_dtype: dtype of the quantized input (what `dequantize` returns by default).
    """

    data: torch.Tensor
    scale: torch.Tensor
    fmt: str
    granularity: str
    orig_dtype: torch.dtype = torch.float32
    may_have_nonfinite: bool = True  # False when made by `quantize` with nonfinite="raise"

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``data * scale`` blockwise, computed in float32 and returned in `dtype` (default: input dtype)."""
        dtype = dtype or self.orig_dtype
        compute = torch.bfloat16 if dtype == torch.bfloat16 and _is_pow2(self.scale) else torch.float32
        out = _dequantize_by_bit_placement(self, compute)
        if out is None:
            values = as_2d(fp8_to_float(self.data, compute, check_nonfinite=self.may_have_nonfinite))
            out = apply_block_scale(values, self.scale.to(compute), self.granularity, torch.mul)
        return out.reshape(self.data.shape).to(dtype)

    def t(self) -> Fp8Tensor:
        """The transpose of a 2-D FP8 tensor (a view: no copy, no requantization)."""
        if self.data.dim() != 2:
            raise ValueError("Fp8Tensor.t() needs a 2-D tensor")
        scale = self.scale if self.scale.dim() == 0 else self.scale.t()
        return Fp8Tensor(
            self.data.t(), scale, self.fmt, TRANSPOSED[self.granularity], self.orig_dtype, self.may_have_nonfinite
        )


def as_2d(x: torch.Tensor) -> torch.Tensor:
    """View an N-D tensor as (rows, cols): leading dimensions flatten into rows, a 1-D tensor is one row."""
    if x.dim() == 0:
        return x.reshape(1, 1)
    if x.dim() == 1:
        return x.reshape(1, -1)
    if x.dim() == 2:
        return x
    return x.reshape(-1, x.shape[-1])


# Bit placement FP8 -> wider float: the 7 magnitude bits of an FP8 byte, shifted to line up with a
# wider format's exponent field, encode value * 2^-k in that format, for normals and subnormals
# alike (k = wider bias - FP8 bias); the sign comes from sign extension and a mask.
_WIDEN = {
    # (fp8 dtype, target dtype): (int dtype, shift, mask keeping sign + 7 magnitude bits, exponent fix k)
    (torch.float8_e4m3fn, torch.bfloat16): (torch.int16, 4, -30736, 120),  # mask 0x87F0
    (torch.float8_e5m2, torch.bfloat16): (torch.int16, 5, -28704, 112),  # mask 0x8FE0
    (torch.float8_e4m3fn, torch.float32): (torch.int32, 20, -2014314496, 120),  # mask 0x87F00000
    (torch.float8_e5m2, torch.float32): (torch.int32, 21, -1881145344, 112),  # mask 0x8FE00000
}
_NONFINITE_BITS = {torch.float8_e4m3fn: (0x7F, 0x7F), torch.float8_e5m2: (0x7C, 0x7C)}  # (mask, pattern)


def fp8_to_float(data: torch.Tensor, dtype: torch.dtype = torch.float32, check_nonfinite: bool = True) -> torch.Tensor:
    """FP8 -> bfloat16 or float32, exact, by bit placement (about 10x faster than torch's cast on CPU).

    `check_nonfinite=False` skips restoring NaN/Inf patterns (for data known to be finite).
    """
    key = (data.dtype, dtype if dtype == torch.bfloat16 else torch.float32)
    if key not in _WIDEN:
        raise TypeError(f"fp8_to_float converts FP8 tensors to bf16/fp32, got {data.dtype} -> {dtype}")
    if data.device.type == "cpu" and _cpu_flushes_denormals():
        # FP8 subnormals land on float32/bf16 subnormals below, which flush-to-zero mode would zero.
        return data.to(dtype)
    out = _placed_bits(data, key[1]).mul_(2.0 ** _WIDEN[key][3])
    if check_nonfinite:
        out = _restore_nonfinite(out, data.view(torch.int8), data.dtype)
    return out if out.dtype == dtype else out.to(dtype)


def _dequantize_by_bit_placement(q: Fp8Tensor, compute: torch.dtype) -> torch.Tensor | None:
    """``data * scale`` as (bit-placed data) * (scale * 2^k): one multiply pass instead of two.

    Bit placement gives ``value * 2^-k`` exactly; ``scale * 2^k`` is exact while finite, so the
    product is the same real number as ``value * scale`` and rounds the same way. None (use the
    two-step path) where that does not hold: NaN/Inf codes, huge scales, flush-to-zero mode.
    """
    key = (q.data.dtype, compute)
    if q.may_have_nonfinite or key not in _WIDEN or (q.data.device.type == "cpu" and _cpu_flushes_denormals()):
        return None
    factor = q.scale.float() * 2.0 ** _WIDEN[key][3]
    if not bool(torch.isfinite(factor).all()):
        return None
    return apply_block_scale(as_2d(_placed_bits(q.data, compute)), factor.to(compute), q.granularity, torch.mul)


def _placed_bits(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 codes as ``value * 2^-k`` in bf16/fp32 (k = `_WIDEN`'s exponent fix), exact for finite codes."""
    int_dtype, shift, mask, _ = _WIDEN[(data.dtype, dtype)]
    return data.view(torch.int8).to(int_dtype).bitwise_left_shift_(shift).bitwise_and_(mask).view(dtype)


def _cpu_flushes_denormals() -> bool:
    """True while `torch.set_flush_denormal(True)` is in effect on this thread (torch has no getter)."""
    return torch.tensor(SMALLEST_FP32_SUBNORMAL * 2.0**10).mul_(0.5).item() == 0.0


def _restore_nonfinite(out: torch.Tensor, bits: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Write back the NaN (and E5M2 Inf) patterns that bit placement turns into large finite values."""
    mask_bits, pattern = _NONFINITE_BITS[fp8_dtype]
    special = (bits & mask_bits) == pattern
    if not bool(special.any()):
        return out
    if fp8_dtype == torch.float8_e4m3fn:
        return out.masked_fill_(special, float("nan"))
    exact = bits[special].view(torch.float8_e5m2).float().to(out.dtype)  # few elements: torch's cast is fine
    out[special] = exact
    return out


def _pad_to_blocks(x2d: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """Zero-pad (R, C) to multiples of the block shape; zeros never change a block's amax."""
    rows, cols = x2d.shape
    pad_rows, pad_cols = (-rows) % block_rows, (-cols) % block_cols
    if pad_rows or pad_cols:
        x2d = torch.nn.functional.pad(x2d, (0, pad_cols, 0, pad_rows))
    return x2d


def _as_blocks(x2d: torch.Tensor, granularity: str) -> tuple[torch.Tensor, int, int]:
    """(R, C) -> zero-padded (R/br, br, C/bc, bc) view, plus the original (R, C)."""
    rows, cols = x2d.shape
    block_rows, block_cols = block_shape(granularity, rows, cols)
    padded = _pad_to_blocks(x2d, block_rows, block_cols)
    n_rows, n_cols = padded.shape[0] // block_rows, padded.shape[1] // block_cols
    return padded.reshape(n_rows, block_rows, n_cols, block_cols), rows, cols


def block_amax(x2d: torch.Tensor, granularity: str) -> torch.Tensor:
    """Per-block max |x| of a (R, C) tensor, float32, shaped like the scales (0-d for "tensor")."""
    if x2d.numel() == 0:
        return torch.zeros(scale_shape(granularity, *x2d.shape), dtype=torch.float32, device=x2d.device)
    if granularity == "tensor":
        low, high = torch.aminmax(x2d)  # one pass for both extremes (per-row aminmax is slow on CPU)
        return torch.maximum(high, -low).float()
    if granularity == "row":
        return torch.maximum(x2d.amax(dim=1, keepdim=True), -x2d.amin(dim=1, keepdim=True)).float()
    if granularity == "col":
        return torch.maximum(x2d.amax(dim=0, keepdim=True), -x2d.amin(dim=0, keepdim=True)).float()
    blocks, _, _ = _as_blocks(x2d, granularity)
    return torch.maximum(blocks.amax(dim=(1, 3)), -blocks.amin(dim=(1, 3))).float()


def _is_pow2(scale: torch.Tensor) -> bool:
    mantissa, _ = torch.frexp(scale.float())
    return bool((mantissa == 0.5).all())


def apply_block_scale(x2d: torch.Tensor, scale: torch.Tensor, granularity: str, op) -> torch.Tensor:
    """``op(x, scale)`` with each block's scale broadcast over the block's elements; returns (R, C)."""
    if granularity in ("tensor", "row", "col"):
        return op(x2d, scale)
    blocks, rows, cols = _as_blocks(x2d, granularity)
    out = op(blocks, scale[:, None, :, None])
    out = out.reshape(blocks.shape[0] * blocks.shape[1], blocks.shape[2] * blocks.shape[3])
    return out[:rows, :cols]


def expand_scale(scale: torch.Tensor, granularity: str, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Broadcast per-block scales back to the element shape `shape` (a materialized tensor)."""
    ones = torch.ones(shape, dtype=torch.float32)
    return apply_block_scale(as_2d(ones), scale, granularity, torch.mul).reshape(shape)


def round_up_pow2(scale: torch.Tensor, clamp_e8m0: bool = False) -> torch.Tensor:
    """Smallest power of two >= scale (exact, via frexp), optionally clamped to the E8M0 range."""
    mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    if clamp_e8m0:
        exponent = exponent.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    return torch.ldexp(torch.ones_like(scale), exponent)


def scale_from_amax(amax: torch.Tensor, fmt: Fp8Format, pow2: bool, e8m0: bool = False) -> torch.Tensor:
    """``scale = amax / fmt_max`` (float32); an all-zero block gets scale 1.

    A zero block then quantizes to exact zeros and dequantizes to exact zeros. A nonzero block so
    small that ``amax / fmt_max`` underflows float32 gets the smallest positive float32 instead (then
    ``|x| / scale <= fmt_max`` still holds), so its values are not silently flushed to zero.
    """
    return _scale_from_amax(amax, fmt.max, pow2, e8m0)


def _scale_from_amax(amax: torch.Tensor, fmt_max: float | torch.Tensor, pow2: bool, e8m0: bool) -> torch.Tensor:
    # The divisor is a tensor on amax's device: CUDA divides by a Python number (a CPU scalar) as a multiplication
    # by its inexact reciprocal, which gave other float32 scales than the CPU's (seen on an H200,
    # results/gpu/); a tensor divisor is an IEEE division on both. Under torch.compile fmt_max is a 0-d tensor
    # already, for the same reason.
    amax = amax.float()
    if not isinstance(fmt_max, torch.Tensor):
        fmt_max = torch.full((), fmt_max, dtype=torch.float32, device=amax.device)  # a fill, no host-to-device copy
    scale = amax / fmt_max
    scale = torch.where((scale == 0) & (amax > 0), torch.full_like(scale, SMALLEST_FP32_SUBNORMAL), scale)
    if pow2:
        scale = round_up_pow2(scale, clamp_e8m0=e8m0)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _check_finite(amax: torch.Tensor, nonfinite: str, all_finite: torch.Tensor | None = None) -> None:
    """Raise (in "raise" mode) when `amax` (any reduction that propagates NaN/Inf) is not finite.

    `all_finite`, when given, is ``isfinite(amax).all()`` already computed (inside a compiled graph).
    """
    if nonfinite != "raise":
        return
    if not bool(torch.isfinite(amax).all() if all_finite is None else all_finite):
        raise ValueError(
            "FP8 quantization input contains NaN or Inf; fix the upstream overflow, or pass "
            "nonfinite='propagate' to keep them as NaN in the FP8 output"
        )


def _scale_and_cast(
    x2d: torch.Tensor,
    scale: torch.Tensor,
    granularity: str,
    fp8: Fp8Format,
    saturate: bool = True,
    in_place: bool = False,
) -> torch.Tensor:
    """Divide by the block scales in float32, saturate to +-fmt_max, round to nearest even in the FP8 dtype.

    `saturate=False` is for scales computed from this tensor's own block amax that are all normal
    float32 numbers: then every quotient is at most ``amax / fl(amax / fmt_max) <= fmt_max * (1 + 2^-23)``,
    which rounds to fmt_max (E4M3: the next code, 480, is NaN's encoding and is reached only from 464
    up; E5M2: inf from 61440 up), so the clamp would change no value and its pass is skipped. A
    subnormal scale has a larger rounding error, so it always saturates. `in_place=True` divides a
    float32 `x2d` that the caller owns in place (one buffer fewer).
    """
    if not saturate and not bool((scale >= SMALLEST_FP32_NORMAL).all()):
        saturate = True
    # Convert first: a mixed-dtype division (bf16 x, float32 scale) took ~20x as long on CPU as both passes.
    divide = torch.Tensor.div_ if in_place and x2d.dtype == torch.float32 else torch.div
    scaled = apply_block_scale(x2d.float(), scale, granularity, divide)
    if saturate:
        scaled = scaled.clamp_(-fp8.max, fp8.max)
    return scaled.to(fp8.dtype)


def quantize(
    x: torch.Tensor,
    fmt: str = "e4m3",
    granularity: str = "tensor",
    pow2_scale: bool = False,
    *,
    nonfinite: str = "raise",
    amax: torch.Tensor | None = None,
    compile: bool = False,
) -> Fp8Tensor:
    """Quantize `x` to FP8 with one scale per block of `granularity`.

    Args:
        x: any float tensor; for granularities other than "tensor" it is read as (R, C) with
            leading dimensions flattened into rows.
        fmt: "e4m3" (max 448) or "e5m2" (max 57344).
        granularity: "tensor", "row", "col", "block_1x128", "block_128x128", "mx_1x32" (and the
            transposed "block_128x1", "mx_32x1").
        pow2_scale: round every scale up to a power of two (always on for MXFP8).
        nonfinite: "raise" (default) rejects NaN/Inf with a clear error; "propagate" computes the
            scales from the finite elements and writes NaN for every non-finite element.
        amax: precomputed amax shaped like the scales (delayed scaling); default: the current amax.
        compile: with current scaling (no `amax` given), run amax, scales and cast as one
            `torch.compile`d graph (opt-in fast path, bit-identical to eager; compiles once per
            shape, dtype, granularity and format, and runs eagerly past dynamo's recompile limit).
    """
    fp8 = get_format(fmt)
    check_granularity(granularity)
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"unknown nonfinite mode {nonfinite!r}; valid modes: {list(NONFINITE_MODES)}")
    if not x.is_floating_point() or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"quantize expects a float32/bfloat16/float16 tensor, got {x.dtype}")
    x2d = as_2d(x)
    finite_mask = None
    if nonfinite == "propagate":
        finite_mask = torch.isfinite(x2d)
        x2d = torch.where(finite_mask, x2d, torch.zeros_like(x2d))
    e8m0 = granularity in POW2_ONLY
    if compile and amax is None:
        amax, all_finite, scale, data = _quantize_compiled(x2d, fp8, granularity, pow2_scale or e8m0, e8m0)
        _check_finite(amax, nonfinite, all_finite)
    else:
        # Reductions and divisions run on a float32 copy (exact for bf16/fp16; CPU reductions over
        # bf16 are several times slower than the conversion plus float32 reductions).
        owned = x2d.dtype != torch.float32  # then the float32 copy is ours to divide in place
        x2d = x2d.float()
        given_amax = amax is not None
        if amax is None:
            amax = block_amax(x2d, granularity)
            _check_finite(amax, nonfinite)
        else:
            # A given amax (delayed scaling) says nothing about x itself: NaN/Inf in x must still raise.
            if not bool(torch.isfinite(amax).all()):
                raise ValueError("the amax given to quantize must be finite")
            if nonfinite == "raise":
                _check_finite(block_amax(x2d, "tensor"), nonfinite)
        scale = scale_from_amax(amax, fp8, pow2_scale or e8m0, e8m0=e8m0)
        data = _scale_and_cast(x2d, scale, granularity, fp8, saturate=given_amax, in_place=owned)
    if finite_mask is not None:
        data = torch.where(finite_mask, data.float(), torch.full_like(x2d, float("nan"), dtype=torch.float32))
        data = data.to(fp8.dtype)
    return Fp8Tensor(
        data=data.reshape(x.shape),
        scale=scale,
        fmt=fp8.name,
        granularity=granularity,
        orig_dtype=x.dtype,
        may_have_nonfinite=finite_mask is not None,
    )


def dequantize(q: Fp8Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Inverse of `quantize` up to FP8 rounding: ``data * scale`` blockwise."""
    return q.dequantize(dtype)


def fake_quantize(
    x: torch.Tensor,
    fmt: str = "e4m3",
    granularity: str = "tensor",
    pow2_scale: bool = False,
    *,
    nonfinite: str = "raise",
    amax: torch.Tensor | None = None,
    compile: bool = False,
) -> torch.Tensor:
    """Quantize then dequantize (same signature as `quantize`); returns x's dtype and shape."""
    return quantize(x, fmt, granularity, pow2_scale, nonfinite=nonfinite, amax=amax, compile=compile).dequantize()


def _block_amax_of_abs(x2d: torch.Tensor, granularity: str) -> torch.Tensor:
    """`block_amax` as one max-reduction of |x| (fused by inductor; eager would materialize |x|).

    Equal to `block_amax` wherever it matters: the same finite maxima, NaN/Inf propagated alike; only
    the sign of an all-zero block's amax may differ, and such a block gets scale 1 either way.
    """
    if x2d.numel() == 0 or granularity == "col":
        return block_amax(x2d, granularity)
    magnitude = x2d.abs()
    if granularity == "tensor":
        return magnitude.amax().float()
    if granularity == "row":
        return magnitude.amax(dim=1, keepdim=True).float()
    blocks, _, _ = _as_blocks(magnitude, granularity)
    return blocks.amax(dim=(1, 3)).float()


def _quantize_2d(
    x2d: torch.Tensor, fmt_max: torch.Tensor, granularity: str, fp8: Fp8Format, pow2: bool, e8m0: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(amax, isfinite(amax).all(), scale, data) of current scaling in one graph, for `torch.compile`.

    The finiteness flag is computed in the graph: as a separate eager op on the ~10^5 block amaxes
    it cost more than the whole graph on a loaded 2-core machine (OpenMP hand-off).

    x2d's shape must be a multiple of the block shape (`_quantize_compiled` pads it): inductor
    (torch 2.13, CPU) miscompiles partial blocks, both the padded-block view (wrong scale read) and
    a per-element gather of the scales (a single row: only the first block written).
    """
    amax = _block_amax_of_abs(x2d, granularity)
    scale = _scale_from_amax(amax, fmt_max, pow2, e8m0)
    return amax, torch.isfinite(amax).all(), scale, _scale_and_cast(x2d, scale, granularity, fp8)


def _quantize_compiled(
    x2d: torch.Tensor, fp8: Fp8Format, granularity: str, pow2: bool, e8m0: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(amax, all finite, scale, data) by the compiled graph; partial blocks are zero-padded here, eagerly.

    Zeros never change a block's amax, and the padding's FP8 values are sliced off again.
    """
    rows, cols = x2d.shape
    padded = x2d
    if granularity not in ("tensor", "row", "col") and x2d.numel() > 0:
        padded = _pad_to_blocks(x2d, *block_shape(granularity, rows, cols))
    amax, all_finite, scale, data = _compiled_quantize_2d()(padded, torch.tensor(fp8.max), granularity, fp8, pow2, e8m0)
    if padded is not x2d:
        data = data[:rows, :cols]
    return amax, all_finite, scale, data


@functools.cache
def _compiled_quantize_2d():
    """`torch.compile`d `_quantize_2d`: the eager path's ops, so its bits.

    Bit-identity with the eager path is asserted by tests/quant/test_tensor.py and by
    benchmarks/quant_throughput.py.
    """
    return torch.compile(_quantize_2d, dynamic=False, options=_eager_division_option())


def _eager_division_option() -> dict[str, bool]:
    """Inductor's switch that makes a compiled float32 division on CUDA round as eager's (Triton's ``/`` is
    ``div.full``, an approximation; with it, ``div_rn``): the compiled quantizer then gives eager's codes and
    scales on a GPU too. Its name moved between torch versions; CPU code generation divides exactly either way."""
    from torch._inductor import config

    if hasattr(getattr(config, "eager_numerics", None), "division_rounding"):
        return {"eager_numerics.division_rounding": True}
    if hasattr(config, "emulate_divison_rounding"):
        return {"emulate_divison_rounding": True}
    return {}
