"""benchmarks/gpu_sections.py on CPU: the scale layouts it hands torch._scaled_mm satisfy torch's own acceptance rules,
the MXFP8 swizzle is torchao's, the GEMM operands are the emulator's, the CPU parts of the probe and the GEMM check run,
and the RL arms equal what the sweeps' YAML composes."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from . import load_benchmark


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return ceil_div(a, b) * b


def size_stride(scale: torch.Tensor, dim: int, size: int, stride: int) -> bool:
    return scale.size(dim) == size and (size <= 1 or scale.stride(dim) == stride)


# torch's legacy _scaled_mm acceptance, ported from aten/src/ATen/native/cuda/ScaledBlas.cpp (is_*_scaling and
# get_joint_scaling's pairs): the layouts a GPU checks before it runs, which a CPU (it has no blockwise or MXFP8
# kernel) never does.
def accepted_as(t: torch.Tensor, scale: torch.Tensor, kind: str) -> bool:
    fp32 = scale.dtype == torch.float32
    if kind == "tensor":
        return fp32 and scale.numel() == 1
    if kind == "row":
        return fp32 and scale.dim() == 2 and scale.shape == (t.size(0), 1) and scale.is_contiguous()
    if kind == "1x128":
        return (
            fp32
            and scale.dim() == 2
            and size_stride(scale, 0, t.size(0), 1)
            and size_stride(scale, 1, ceil_div(t.size(1), 128), t.size(0))
        )
    if kind == "128x128":
        return (
            fp32
            and scale.dim() == 2
            and size_stride(scale, 0, ceil_div(t.size(0), 128), ceil_div(t.size(1), 128))
            and size_stride(scale, 1, ceil_div(t.size(1), 128), 1)
        )
    if kind == "mx":
        numel = round_up(t.size(0), 128) * round_up(ceil_div(t.size(1), 32), 4)
        return scale.dtype == torch.float8_e8m0fnu and scale.numel() == numel and scale.is_contiguous()
    raise ValueError(kind)


PAIRS = (("tensor", "tensor"), ("row", "row"), ("128x128", "1x128"), ("1x128", "128x128"), ("1x128", "1x128"))
PAIRS += (("mx", "mx"),)


def joint_scaling(a, b, scale_a, scale_b):
    for lhs, rhs in PAIRS:
        scale_b_check = scale_b if rhs == "mx" else scale_b.t()
        if accepted_as(a, scale_a, lhs) and accepted_as(b.t(), scale_b_check, rhs):
            return lhs, rhs
    return None


EXPECTED_KINDS = {
    "tensorwise": {g: ("tensor", "tensor") for g in ("fprop", "dgrad", "wgrad")},
    "rowwise": {g: ("row", "row") for g in ("fprop", "dgrad", "wgrad")},
    "blockwise": {"fprop": ("1x128", "128x128"), "dgrad": ("1x128", "128x128"), "wgrad": ("1x128", "1x128")},
    "mxfp8": {g: ("mx", "mx") for g in ("fprop", "dgrad", "wgrad")},
}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise", "mxfp8"])
def test_every_gemms_scales_are_laid_out_as_torch_scaled_mm_accepts_them(recipe) -> None:
    sections = load_benchmark("gpu_sections")
    x, w, dy = sections.test_tensors(256, 512, 384, "cpu")
    for gemm, (qa, qb) in sections.gemm_operands(recipe, x, w, dy).items():
        a, b = qa.data.contiguous(), qb.data.contiguous().t()
        sa, sb = sections.legacy_scales(
            sections.KIND[qa.granularity], qa.scale, sections.KIND[qb.granularity], qb.scale
        )
        assert b.stride(0) == 1, "b must be column-major"
        assert joint_scaling(a, b, sa, sb) == EXPECTED_KINDS[recipe][gemm], (recipe, gemm, sa.stride(), sb.stride())


def test_a_transposed_rowwise_scale_is_copied_to_unit_stride() -> None:
    """dgrad/wgrad scales are views of a transpose: a (N, 1) view keeps a stride that _scaled_mm refuses."""
    sections = load_benchmark("gpu_sections")
    view = torch.rand(1, 384).t()
    sa, sb = sections.legacy_scales("row", view, "row", view)
    assert sa.stride() == (1, 1) and sb.stride(1) == 1 and torch.equal(sa.flatten(), view.flatten())


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="compares with torchao's to_blocked")
@pytest.mark.parametrize("shape", [(128, 4), (256, 16), (300, 17), (1, 1), (384, 128)])
def test_the_mx_swizzle_is_torchaos_to_blocked(shape) -> None:
    from torchao.prototype.mx_formats.utils import to_blocked

    sections = load_benchmark("gpu_sections")
    scale = torch.rand(shape) + 0.5
    ours, theirs = sections.swizzle_mx_scales(scale), to_blocked(scale)
    rows, cols = shape
    assert ours.numel() == round_up(rows, 128) * round_up(cols, 4)
    # both pad with a fill value (ones here, zeros there); the real entries land in the same places
    real = to_blocked(torch.ones(shape)).bool()
    assert torch.equal(ours[real], theirs[real])


def test_power_of_two_scales_convert_to_e8m0_exactly() -> None:
    from fp8rl.quant import quantize

    q = quantize(torch.randn(64, 256) * 1e3, "e4m3", "mx_1x32")
    e8m0 = q.scale.to(torch.float8_e8m0fnu)
    assert torch.equal(e8m0.float(), q.scale)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise", "mxfp8"])
def test_the_gemm_operands_are_the_emulators(recipe) -> None:
    """fp8_gemm of the check's operands equals fp8_linear's forward, dgrad and wgrad bit for bit (FP32)."""
    from fp8rl.quant import fp8_gemm, fp8_linear

    sections = load_benchmark("gpu_sections")
    x, w, dy = sections.test_tensors(256, 256, 128, "cpu", seed=3)
    ops = sections.gemm_operands(recipe, x, w, dy)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(xg, wg, None, recipe)
    y.backward(dy)
    assert torch.equal(y, fp8_gemm(*ops["fprop"], torch.float32))
    assert torch.equal(xg.grad, fp8_gemm(*ops["dgrad"], torch.float32))
    assert torch.equal(wg.grad, fp8_gemm(*ops["wgrad"], torch.float32))


def test_quantizer_cases_cover_every_operand_usage() -> None:
    sections = load_benchmark("gpu_sections")
    assert sections.quantizer_cases("tensorwise") == [
        ("x", "tensor", "e4m3"),
        ("w", "tensor", "e4m3"),
        ("dy", "tensor", "e5m2"),
    ]
    assert {g for _, g, _ in sections.quantizer_cases("blockwise")} == {"block_1x128", "block_128x1", "block_128x128"}
    assert {g for _, g, _ in sections.quantizer_cases("mxfp8")} == {"mx_1x32", "mx_32x1"}


def test_the_cpu_parts_of_the_probe_and_the_gemm_check_run() -> None:
    sections = load_benchmark("gpu_sections")
    probe = sections.probe("cpu")
    assert probe["apis"]["torch._scaled_mm"]["tensorwise e4m3 x e4m3 -> fp32"].startswith("accepted")
    result = sections.gemm("cpu", 128, 256, 128)
    assert all(c["ok"] for c in result["checks"]) and result["device"] == "cpu"
    ran = result["table"]["tensorwise"]["fprop"]["hardware"]
    assert ran["rel"] <= ran["bound"] and math.isfinite(ran["rel"])


def test_the_accumulation_bound_grows_with_k_and_a_bf16_output() -> None:
    sections = load_benchmark("gpu_sections")
    fp32, bf16 = sections.accumulation_bound(4096, torch.float32), sections.accumulation_bound(4096, torch.bfloat16)
    assert 2.0**-7 < fp32 < bf16 and bf16 - fp32 == 2.0**-8
    assert sections.accumulation_bound(8192, torch.float32) > fp32


@pytest.mark.skipif(importlib.util.find_spec("hydra") is None, reason="compares with the Hydra composition")
@pytest.mark.parametrize("arm", ["bf16", "fp8_tensorwise", "cc_tensorwise"])
def test_the_rl_arms_equal_the_sweeps_tiny_arms(arm) -> None:
    """The GPU image has no Hydra: the arms are dataclass overrides, and must mean what the YAML means."""
    from fp8rl.compose import compose_config

    sections = load_benchmark("gpu_sections")
    steps = 3
    composed = compose_config(
        [
            "scale=tiny",
            f"+experiment/arm={arm}",
            f"clipping.interval={sections.RL_INTERVAL}",
            f"trainer.steps={steps}",
            "tracking.enabled=false",
        ]
    )
    assert sections.rl_arm_config(arm, "cpu", steps) == composed
