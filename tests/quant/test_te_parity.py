"""The emulator against Transformer Engine 2.x on a GPU: quantizers bit for bit, GEMMs within a bound.

Skipped (with the reason) where no CUDA device is found or transformer_engine cannot be imported.

Where the comparison is bitwise and why. TE quantizes with a multiplier ``scale = fmt_max / amax``
and stores ``scale_inv = 1 / scale``; the emulator divides by ``scale = amax / fmt_max``. With
power-of-two scales (TE's blockwise and MXFP8 recipes, and current scaling with
``force_pow_2_scales``) both are exact, and the scales are the same power of two: TE rounds its
multiplier down, the emulator its divisor up, and no float32 amax puts ``amax / fmt_max`` within a
float32 rounding of a power of two without being one (fmt_max = 7 * 2^k). So codes and scales must
match bit for bit. With float32 current-scaling scales the two conventions round differently
(``x * fl(448 / amax)`` vs ``x / fl(amax / 448)``): scales agree to one float32 ulp and a code can
move by one FP8 step where x sits within a rounding of a tie; that is what the float32 test allows.

GEMMs are compared on identically quantized operands: TE's cuBLAS FP8 GEMM accumulates in tensor
cores with at least ~14-bit partial sums promoted to FP32 every 128 elements (DeepSeek-V3, 3.3.2),
so its result lies within 128 * 2^-14 = 2^-7 of sum_k |a_hat_k||b_hat_k| of the exact product of the
FP8 operands, and the emulator's within (n + 6) 2^-24 of it.
"""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (none found)", allow_module_level=True)
te = pytest.importorskip("transformer_engine.pytorch", reason="needs transformer_engine (pip install 'fp8rl[gpu]')")
tex = pytest.importorskip("transformer_engine_torch", reason="needs transformer_engine's torch extension")
te_recipe = pytest.importorskip("transformer_engine.common.recipe")

from fp8rl.quant import fp8_linear, get_format, get_recipe, quantize  # noqa: E402

TE_DTYPE = {"e4m3": tex.DType.kFloat8E4M3, "e5m2": tex.DType.kFloat8E5M2}
FMTS = ("e4m3", "e5m2")
DEVICE = torch.device("cuda")


def te_class(name: str):
    """A TE quantizer class, from the top-level package (newer TE) or its tensor module (2.x)."""
    if hasattr(te, name):
        return getattr(te, name)
    for module in ("float8_tensor", "float8_blockwise_tensor", "mxfp8_tensor"):
        mod = importlib.import_module(f"transformer_engine.pytorch.tensor.{module}")
        if hasattr(mod, name):
            return getattr(mod, name)
    pytest.fail(f"transformer_engine has no {name}")


def require(kind: str) -> None:
    """Skip unless TE reports support for `kind` ("fp8", "mxfp8", "fp8_block_scaling") on this GPU."""
    for module in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        with contextlib.suppress(ImportError):
            check = getattr(importlib.import_module(module), f"check_{kind}_support", None)
            if check is not None:
                available, reason = check()
                if not available:
                    pytest.skip(f"TE: no {kind} on this GPU: {reason}")
                return


def fp8_autocast(recipe):
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def sample_input(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(rows, cols, device=DEVICE, generator=g)
    x *= torch.exp2(torch.randint(-6, 7, (rows, 1), device=DEVICE, generator=g).float())
    x[:, 5] *= 100  # an outlier channel
    x[3] = 0  # a zero row
    return x


def codes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def block_scales(scale_inv: torch.Tensor, rows: int, cols: int, transposed_gemm_layout: bool) -> torch.Tensor:
    """The (rows, cols) scales inside TE's padded scale tensor (GEMM-ready layouts may be transposed)."""
    if transposed_gemm_layout and scale_inv.shape[0] == cols and scale_inv.shape[1] >= rows:
        return scale_inv[:cols, :rows].t()
    assert scale_inv.shape[0] >= rows and scale_inv.shape[1] >= cols, (scale_inv.shape, rows, cols)
    return scale_inv[:rows, :cols]


# ---------------------------------------------------------------- per-tensor quantizers


@pytest.mark.parametrize("fmt", FMTS)
def test_delayed_scaling_quantizer_matches_with_a_given_scale(fmt):
    require("fp8")
    x = sample_input(256, 512)
    x[0, 0] = 1e6  # beyond fmt_max * scale_inv: saturated by both
    fmt_max = get_format(fmt).max
    quantizer = te_class("Float8Quantizer")(
        scale=torch.full((1,), 0.5, device=DEVICE), amax=torch.zeros(1, device=DEVICE), fp8_dtype=TE_DTYPE[fmt]
    )
    ours = quantize(x, fmt, "tensor", amax=torch.tensor(2 * fmt_max, device=DEVICE))  # scale 2 = 1 / 0.5
    theirs = quantizer.quantize(x)
    assert float(ours.scale) == 2.0 and float(theirs._scale_inv) == 2.0
    assert torch.equal(codes(theirs._data), codes(ours.data))


@pytest.mark.parametrize("fmt", FMTS)
def test_current_scaling_quantizer_with_pow2_scales_matches_bit_for_bit(fmt):
    require("fp8")
    x = sample_input(256, 512, seed=1)
    quantizer = te_class("Float8CurrentScalingQuantizer")(TE_DTYPE[fmt], device=DEVICE, force_pow_2_scales=True)
    theirs, ours = quantizer.quantize(x), quantize(x, fmt, "tensor", pow2_scale=True)
    assert torch.equal(theirs._scale_inv.reshape(()), ours.scale)
    assert torch.equal(codes(theirs._data), codes(ours.data))


@pytest.mark.parametrize("fmt", FMTS)
def test_current_scaling_quantizer_with_float32_scales_agrees_up_to_the_convention(fmt):
    require("fp8")
    x = sample_input(512, 1024, seed=2)
    quantizer = te_class("Float8CurrentScalingQuantizer")(TE_DTYPE[fmt], device=DEVICE)
    theirs, ours = quantizer.quantize(x), quantize(x, fmt, "tensor")
    scale_theirs = theirs._scale_inv.reshape(())
    assert abs(float(scale_theirs) - float(ours.scale)) <= 2.0**-23 * float(ours.scale)
    ours_values, theirs_values = ours.data.float(), theirs._data.view(ours.data.dtype).float()
    differs = ours_values != theirs_values
    assert float(differs.float().mean()) < 1e-3
    # one FP8 step at most: relative 2^-m in the normal range, the subnormal spacing below it
    spec = get_format(fmt)
    step = torch.maximum(ours_values.abs() * 2.0**-spec.mantissa_bits, torch.tensor(spec.min_subnormal, device=DEVICE))
    assert bool(((ours_values - theirs_values).abs() <= step).all())


# ---------------------------------------------------------------- block quantizers


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("shape", [(256, 384), (272, 400)])  # the second has partial 128-blocks
def test_block_quantizer_matches_bit_for_bit(fmt, dim, shape):
    require("fp8_block_scaling")
    rows, cols = shape
    x = sample_input(rows, cols, seed=3)
    quantizer = te_class("Float8BlockQuantizer")(
        TE_DTYPE[fmt], rowwise=True, columnwise=True, force_pow_2_scales=True, block_scaling_dim=dim
    )
    theirs = quantizer.quantize(x)
    rowwise = quantize(x, fmt, "block_1x128" if dim == 1 else "block_128x128", pow2_scale=True)
    columnwise = quantize(x, fmt, "block_128x1" if dim == 1 else "block_128x128", pow2_scale=True)

    assert torch.equal(codes(theirs._rowwise_data), codes(rowwise.data))
    n_rows, n_cols = rowwise.scale.shape
    assert torch.equal(block_scales(theirs._rowwise_scale_inv, n_rows, n_cols, dim == 1), rowwise.scale)

    # TE stores the columnwise copy transposed: (cols, rows), scaled along its rows.
    assert torch.equal(codes(theirs._columnwise_data), codes(columnwise.data.t()))
    col_scale = columnwise.scale.t()  # scales of x^T's blocks
    got = block_scales(theirs._columnwise_scale_inv, col_scale.shape[0], col_scale.shape[1], dim == 1)
    assert torch.equal(got, col_scale)


@pytest.mark.parametrize("fmt", FMTS)
def test_mxfp8_quantizer_matches_bit_for_bit(fmt):
    require("mxfp8")
    rows, cols = 256, 512
    x = sample_input(rows, cols, seed=4)
    quantizer = te_class("MXFP8Quantizer")(TE_DTYPE[fmt], rowwise=True, columnwise=True)
    if hasattr(quantizer, "optimize_for_gemm"):
        quantizer.optimize_for_gemm = False  # compact (unswizzled) scales
    theirs = quantizer.quantize(x)
    assert not getattr(theirs, "_with_gemm_swizzled_scales", False)
    rowwise, columnwise = quantize(x, fmt, "mx_1x32"), quantize(x, fmt, "mx_32x1")

    def e8m0(scale_inv: torch.Tensor, n_rows: int, n_cols: int) -> torch.Tensor:
        biased = scale_inv[:n_rows, :n_cols].view(torch.uint8).int()
        return torch.exp2(biased.float() - 127)

    assert torch.equal(codes(theirs._rowwise_data), codes(rowwise.data))
    assert torch.equal(e8m0(theirs._rowwise_scale_inv, rows, cols // 32), rowwise.scale)
    # MXFP8's columnwise copy keeps x's layout, with 32x1 blocks
    assert torch.equal(codes(theirs._columnwise_data), codes(columnwise.data))
    assert torch.equal(e8m0(theirs._columnwise_scale_inv, rows // 32, cols), columnwise.scale)


# ---------------------------------------------------------------- a whole linear layer


TE_LINEAR_CASES = {  # our recipe -> (TE recipe class, TE feature, extra operand error of the scale convention)
    "blockwise": ("Float8BlockScaling", "fp8_block_scaling", 0.0),  # pow2 scales: identical operands
    "mxfp8": ("MXFP8BlockScaling", "mxfp8", 0.0),  # E8M0 scales: identical operands
    "tensorwise": ("Float8CurrentScaling", "fp8", 2.0**-3),  # float32 scales: a code may move one step
}


@pytest.mark.parametrize("recipe", sorted(TE_LINEAR_CASES))
def test_te_linear_matches_fp8_linear(recipe):
    """Forward, dgrad and wgrad of te.Linear under the TE recipe vs fp8_linear(recipe).

    With power-of-two scales both quantize every operand identically (the quantizer tests), so they differ
    only by GEMM accumulation: within (2^-7 + (n + 6) 2^-24) sum_k |a_k||b_k| of each other (module
    docstring), bounded with the unquantized magnitudes times (1 + 2^-4)^2 for the quantized ones. With
    float32 current scaling an operand code can move by one FP8 step (2^-3 relative) where the two scale
    conventions round differently; that adds 2 * 2^-3 to the factor.
    """
    te_class, feature, convention = TE_LINEAR_CASES[recipe]
    require(feature)
    m, k, n = 256, 512, 384
    x = sample_input(m, k, seed=5)
    w = torch.randn(n, k, device=DEVICE) / k**0.5
    dy = torch.randn(m, n, device=DEVICE) * 1e-2

    layer = te.Linear(k, n, bias=False, params_dtype=torch.float32, device=DEVICE)
    with torch.no_grad():
        layer.weight.copy_(w)
    x_te = x.clone().requires_grad_()
    with fp8_autocast(getattr(te_recipe, te_class)(fp8_format=te_recipe.Format.E4M3)):
        y_te = layer(x_te)
    y_te.backward(dy)

    x_ours, w_ours = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_ours = fp8_linear(x_ours, w_ours, None, get_recipe(recipe))
    y_ours.backward(dy)

    def bound(a: torch.Tensor, b: torch.Tensor, reduction: int) -> torch.Tensor:
        factor = 2.0**-7 + (reduction + 6) * 2.0**-24 + 2 * convention
        return factor * (1 + 2.0**-4) ** 2 * (a.abs() @ b.abs().t())

    assert bool(((y_te - y_ours).abs() <= bound(x, w, k)).all())
    assert bool(((x_te.grad - x_ours.grad).abs() <= bound(dy, w.t(), n)).all())
    assert bool(((layer.weight.grad - w_ours.grad).abs() <= bound(dy.t(), x.t(), m)).all())
