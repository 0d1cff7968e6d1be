"""The sections of `benchmarks/gpu_check.sh` that need only torch and the GPU bundle (no Transformer Engine, no vLLM).

Each section takes the device under test ("cuda", or "cpu" in a rehearsal on a machine without a GPU) and returns
a dict with ``device``, its measurements and ``checks`` (a list of ``{"what", "ok", ...}``); it raises `Skip`
when its stack or device is missing. `benchmarks/gpu_bench.py` turns that into a status: passed (every check
held, on a GPU), rehearsed (every check held, on the CPU: the code ran, nothing about a GPU was measured),
failed, or skipped.

- ``probe``: which scalings ``torch._scaled_mm`` (and ``torch.nn.functional.scaled_mm`` where torch has it) take
  on this device: tensorwise, rowwise, DeepSeek blockwise (1x128 activations x 128x128 weights, and 1x128 x 1x128)
  and MXFP8 (1x32, E8M0 scales in cuBLAS's swizzled layout), each tried on a small GEMM: accepted, or refused
  with the error.
- ``quantizers``: fp8rl's emulated quantizers on the device against the same on the CPU, codes and scales bit for
  bit, for every operand usage of every recipe (tensorwise with E5M2 gradients; rowwise with power-of-two scales;
  blockwise with FP32 scales; MXFP8), bf16 and fp32 inputs, partial blocks, an all-zero block and a block whose
  scale is subnormal; on a GPU also the compiled quantizer (``compile=True``) for two granularities.
- ``gemm``: the hardware FP8 GEMM (where the device takes the scaling) per recipe and per GEMM (fprop, dgrad,
  wgrad) on the emulator's FP8 codes and scales, against the exact product of the same codes in FP64; the
  emulator's own GEMM beside it.
- ``train_step``: a training step (forward, backward, AdamW) of a Qwen3-8B-shaped layer stack in BF16 vs torchao
  float8 training (``Float8LinearConfig.from_recipe_name``: "tensorwise", "rowwise"), eager and compiled, as
  throughput ratios measured in this one run.
- ``rl``: a few RL steps of the tiny task in three arms (BF16; full-pipeline FP8 tensorwise; FP8 + Calibrated
  Clipping), on the GPU and the same steps on the CPU, compared metric by metric.
- ``torchao_rl``: fp8rl's own ``precision.backend=torchao`` (its block linears' FP8 GEMMs through torchao's float8
  training: ``torch._scaled_mm`` on a GPU) in the tiny RL run, tensorwise and rowwise, beside the emulated backend's
  same arm on the same device; and whether the real GEMMs need their inner dimension padded to 16 (an RL batch's
  token count is the wgrad GEMM's inner dimension).

API facts used here were checked against torch 2.13's installed source and torch's ScaledBlas.cpp (main branch):
``torch._scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False)``
with ``b`` column-major; ``torch.nn.functional.scaled_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b,
scale_recipe_b, swizzle_a=None, swizzle_b=None, bias=None, output_dtype=torch.bfloat16, contraction_dim=(),
use_fast_accum=False)`` with ``ScalingType.{TensorWise, RowWise, BlockWise1x32, BlockWise1x128,
BlockWise128x128}`` and ``SwizzleType.{NO_SWIZZLE, SWIZZLE_32_4_4}``. torch 2.11 (the GPU image) may differ:
the probe records the schemas the device's torch has, and a refusal's error text, rather than assuming them.
"""

from __future__ import annotations

import copy
import gc
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8")
GEMMS = ("fprop", "dgrad", "wgrad")


class Skip(Exception):
    """This section (or this part of one) cannot run here; the message says why."""


def check(what: str, ok: bool, **values: Any) -> dict[str, Any]:
    return {"what": what, "ok": bool(ok), **values}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def capability() -> tuple[int, int] | None:
    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None


def error_text(err: BaseException, limit: int = 400) -> str:
    first = str(err).strip().splitlines()
    return f"{type(err).__name__}: {first[0][:limit] if first else ''}"


# ------------------------------------------------------------------------------------ scale layouts
def swizzle_mx_scales(scale: torch.Tensor) -> torch.Tensor:
    """(rows, K/32) MXFP8 scales -> cuBLAS's blocked layout ("32_4_4", flattened): rows padded to 128 and columns
    to 4, each 128 x 4 tile stored as 32 x 16 (the same rearrangement as torchao's ``mx_formats.utils.to_blocked``;
    tests/benchmarks compares the two)."""
    rows, cols = scale.shape
    padded_rows, padded_cols = -(-rows // 128) * 128, -(-cols // 4) * 4
    padded = scale.new_ones(padded_rows, padded_cols)
    padded[:rows, :cols] = scale
    blocks = padded.view(padded_rows // 128, 128, padded_cols // 4, 4).permute(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten()


KIND = {"tensor": "tensor", "row": "row", "block_1x128": "1x128", "block_128x128": "128x128", "mx_1x32": "mx"}


def _legacy_scale(kind: str, scale: torch.Tensor, is_b: bool) -> torch.Tensor:
    if kind == "tensor":
        return scale.float().reshape(())
    if kind == "row":  # a fresh copy: a (N, 1) view of a transposed scale keeps stride(1) != 1, which is refused
        fresh = scale.float().flatten().clone()
        return fresh.view(1, -1) if is_b else fresh.view(-1, 1)
    if kind == "1x128":
        return scale.float().t().contiguous() if is_b else scale.float().t().contiguous().t()
    if kind == "128x128":
        return scale.float().contiguous().t() if is_b else scale.float().contiguous()
    if kind == "mx":
        return swizzle_mx_scales(scale.float()).to(torch.float8_e8m0fnu)
    raise ValueError(f"unknown scaling kind {kind!r}")


def legacy_scales(kind_a: str, sa: torch.Tensor, kind_b: str, sb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The emulator's scales of A (rows_a, K) and B (rows_b, K), laid out as ``torch._scaled_mm(a, b.t())`` wants
    them (ScaledBlas.cpp's is_*_scaling rules): tensorwise one float; rowwise (M, 1) and (1, N); 1x128
    outer-dim-major, (M, K/128) with strides (1, M) for A and (K/128, N) contiguous for B; 128x128 (M/128, K/128)
    contiguous for A and the transposed view (K/128, N/128), strides (1, K/128), for B; MXFP8 E8M0 in the swizzled
    layout."""
    return _legacy_scale(kind_a, sa, False), _legacy_scale(kind_b, sb, True)


def v2_scales(kind_a: str, sa: torch.Tensor, kind_b: str, sb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same scales for ``F.scaled_mm`` (``_scaled_mm_v2``, ScaledBlas.cpp main): as `legacy_scales` except
    1x128, (rows, K/128) with strides (1, rows) for A and B alike, and 128x128, (round_up(K/128, 4), rows/128)
    with strides (1, round_up(K/128, 4))."""

    def one(kind: str, scale: torch.Tensor, is_b: bool) -> torch.Tensor:
        if kind == "1x128":
            return scale.float().t().contiguous().t()
        if kind == "128x128":
            rows, blocks = scale.shape
            padded = scale.new_ones(rows, -(-blocks // 4) * 4).float()
            padded[:, :blocks] = scale
            return padded.t()
        return _legacy_scale(kind, scale, is_b)

    return one(kind_a, sa, False), one(kind_b, sb, True)


def scaled_mm(qa: Any, qb: Any, out_dtype: torch.dtype, api: str = "legacy", fast_accum: bool = False) -> torch.Tensor:
    """``A @ B^T`` of two fp8rl Fp8Tensors (rows, reduction) by the hardware: ``torch._scaled_mm`` ("legacy") or
    ``torch.nn.functional.scaled_mm`` ("v2")."""
    kind_a, kind_b = KIND[qa.granularity], KIND[qb.granularity]
    a, b = qa.data.contiguous(), qb.data.contiguous().t()  # b: column-major (K, N)
    if api == "legacy":
        sa, sb = legacy_scales(kind_a, qa.scale, kind_b, qb.scale)
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=fast_accum)
    import torch.nn.functional as F

    names = {
        "tensor": "TensorWise",
        "row": "RowWise",
        "1x128": "BlockWise1x128",
        "128x128": "BlockWise128x128",
        "mx": "BlockWise1x32",
    }
    sa, sb = v2_scales(kind_a, qa.scale, kind_b, qb.scale)
    swizzle = {"swizzle_a": F.SwizzleType.SWIZZLE_32_4_4, "swizzle_b": F.SwizzleType.SWIZZLE_32_4_4}
    return F.scaled_mm(
        a,
        b,
        sa,
        getattr(F.ScalingType, names[kind_a]),
        sb,
        getattr(F.ScalingType, names[kind_b]),
        **(swizzle if kind_a == "mx" else {}),
        output_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )


# ------------------------------------------------------------------------------------ operands per GEMM
def gemm_operands(recipe_name: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> dict[str, tuple]:
    """{gemm: (A, B)} as fp8rl.quant.fp8_linear quantizes them (recipes.py's layouts: A (rows, reduction), B
    (cols, reduction)); the transposed usages are quantized along the other dimension, as the emulator does."""
    from fp8rl.quant import get_recipe, quantize
    from fp8rl.quant.granularity import TRANSPOSED

    r = get_recipe(recipe_name)
    pow2 = r.uses_pow2_scales

    def q(t, fmt, gran):
        return quantize(t, fmt, gran, pow2)

    def transposed(t, fmt, gran, q_rowwise):
        return q_rowwise.t() if TRANSPOSED[gran] == gran else q(t, fmt, TRANSPOSED[gran]).t()

    fwd, bwd = r.forward_format, r.backward_format
    qx, qw, qdy = (
        q(x, fwd, r.activation_granularity),
        q(w, fwd, r.weight_granularity),
        q(dy, bwd, r.gradient_granularity),
    )
    return {
        "fprop": (qx, qw),
        "dgrad": (qdy, transposed(w, fwd, r.weight_granularity, qw)),
        "wgrad": (transposed(dy, bwd, r.gradient_granularity, qdy), transposed(x, fwd, r.activation_granularity, qx)),
    }


def exact_float64(q: Any) -> torch.Tensor:
    """The FP8 tensor's values times its block scales in FP64 (exact: FP8 codes and FP32 scales fit in FP64)."""
    from fp8rl.quant.tensor import apply_block_scale, as_2d

    values = as_2d(q.data.float().double())
    return apply_block_scale(values, q.scale.double(), q.granularity, torch.mul)


def test_tensors(m: int, k: int, n: int, device: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """x (m, k) with outlier channels, W (n, k), dy (m, n): drawn on the CPU (the same values on every device)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[:, :8] *= 40
    w = torch.randn(n, k, generator=gen) / k**0.5
    dy = torch.randn(m, n, generator=gen) * 1e-3
    dy[: m // 8] *= 50  # rows of very different magnitude
    return x.to(device), w.to(device), dy.to(device)


# ---------------------------------------------------------------------------------------------- probe
PROBE_CASES = {  # name: (kind A, kind B, fmt A, fmt B, out dtype)
    "tensorwise e4m3 x e4m3 -> fp32": ("tensor", "tensor", "e4m3", "e4m3", torch.float32),
    "tensorwise e5m2 x e4m3 -> fp32": ("tensor", "tensor", "e5m2", "e4m3", torch.float32),
    "tensorwise e4m3 x e4m3 -> bf16": ("tensor", "tensor", "e4m3", "e4m3", torch.bfloat16),
    "rowwise -> bf16": ("row", "row", "e4m3", "e4m3", torch.bfloat16),
    "rowwise -> fp32": ("row", "row", "e4m3", "e4m3", torch.float32),
    "blockwise 1x128 x 128x128 -> bf16": ("1x128", "128x128", "e4m3", "e4m3", torch.bfloat16),
    "blockwise 1x128 x 128x128 -> fp32": ("1x128", "128x128", "e4m3", "e4m3", torch.float32),
    "blockwise 1x128 x 1x128 -> bf16": ("1x128", "1x128", "e4m3", "e4m3", torch.bfloat16),
    "mxfp8 1x32 e8m0 -> bf16": ("mx", "mx", "e4m3", "e4m3", torch.bfloat16),
}
GRANULARITY_OF = {"tensor": "tensor", "row": "row", "1x128": "block_1x128", "128x128": "block_128x128", "mx": "mx_1x32"}


def probe(device: str) -> dict[str, Any]:
    """Try each scaling of `PROBE_CASES` on a (256 x 512) @ (512 x 384) GEMM, through both APIs."""
    from fp8rl.quant import quantize

    x, w, _ = test_tensors(256, 512, 384, device)
    apis = {"torch._scaled_mm": "legacy"}
    import torch.nn.functional as F

    if hasattr(F, "scaled_mm"):
        apis["torch.nn.functional.scaled_mm"] = "v2"
    found: dict[str, dict[str, str]] = {api: {} for api in apis}
    for name, (kind_a, kind_b, fmt_a, fmt_b, out_dtype) in PROBE_CASES.items():
        pow2 = kind_a == "mx"
        qa = quantize(x, fmt_a, GRANULARITY_OF[kind_a], pow2)
        qb = quantize(w, fmt_b, GRANULARITY_OF[kind_b], pow2)
        for label, api in apis.items():
            try:
                out = scaled_mm(qa, qb, out_dtype, api)
                sync(device)
                found[label][name] = f"accepted ({tuple(out.shape)}, {str(out.dtype).removeprefix('torch.')})"
            except Exception as err:  # noqa: BLE001 - a refusal is the finding
                found[label][name] = "refused: " + error_text(err)
    cap = capability()
    schemas = {}
    for op in ("_scaled_mm", "_scaled_mm_v2"):
        packet = getattr(torch.ops.aten, op, None)
        schemas[op] = str(packet.default._schema) if packet is not None else "absent"
    result: dict[str, Any] = {
        "device": device,
        "capability": cap,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "apis": found,
        "schemas": schemas,
        "scaling_types": list(F.ScalingType.__members__) if hasattr(F, "ScalingType") else "absent",
        "swizzle_types": list(F.SwizzleType.__members__) if hasattr(F, "SwizzleType") else "absent",
        "checks": [],
    }
    if device == "cuda" and cap is not None and cap >= (8, 9):
        tw = found["torch._scaled_mm"]["tensorwise e4m3 x e4m3 -> fp32"]
        what = "tensorwise FP8 GEMM accepted on compute capability >= 8.9"
        result["checks"].append(check(what, tw.startswith("accepted")))
    elif device == "cuda":
        result["note"] = f"compute capability {cap}: no FP8 tensor cores (8.9+), every refusal is expected"
    return result


# ----------------------------------------------------------------------------------------- quantizers
def quantizer_cases(recipe_name: str) -> list[tuple[str, str, str]]:
    """(operand, granularity, format) of every operand usage of `recipe_name` (row and column usages)."""
    from fp8rl.quant import get_recipe
    from fp8rl.quant.granularity import TRANSPOSED

    r = get_recipe(recipe_name)
    cases = []
    for operand, gran, fmt in (
        ("x", r.activation_granularity, r.forward_format),
        ("w", r.weight_granularity, r.forward_format),
        ("dy", r.gradient_granularity, r.backward_format),
    ):
        cases.append((operand, gran, fmt))
        if TRANSPOSED[gran] != gran:
            cases.append((operand, TRANSPOSED[gran], fmt))
    return cases


def quantizer_inputs() -> dict[str, torch.Tensor]:
    """CPU float32 inputs: partial blocks (300 x 520), outlier channels, an all-zero 128-block, a block of values
    so small that its scale is subnormal, a row of very large values."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(300, 520, generator=gen)
    x[:, :5] *= 60
    x[:128, 128:256] = 0.0
    x[128:160, 256:288] = torch.randn(32, 32, generator=gen) * 1e-41
    x[299] *= 1e4
    w = torch.randn(264, 520, generator=gen) / 520**0.5
    dy = torch.randn(300, 264, generator=gen) * 1e-4
    return {"x": x, "w": w, "dy": dy}


def quantizers(device: str, compiled: bool | None = None) -> dict[str, Any]:
    """Codes and scales of fp8rl.quant.quantize on `device` against the CPU's, bit for bit."""
    from fp8rl.quant import get_recipe, quantize

    compiled = device == "cuda" if compiled is None else compiled
    inputs = quantizer_inputs()
    rows, mismatched = [], []
    for recipe_name in RECIPES:
        pow2 = get_recipe(recipe_name).uses_pow2_scales
        for operand, gran, fmt in quantizer_cases(recipe_name):
            for dtype in (torch.float32, torch.bfloat16):
                t = inputs[operand].to(dtype)
                ref = quantize(t, fmt, gran, pow2)
                got = quantize(t.to(device), fmt, gran, pow2)
                codes = (ref.data.view(torch.uint8) != got.data.cpu().view(torch.uint8)).sum().item()
                scales = (ref.scale.view(torch.int32) != got.scale.cpu().view(torch.int32)).sum().item()
                name = f"{recipe_name} {operand} {gran} {fmt} {str(dtype).removeprefix('torch.')}"
                rows.append({"case": name, "codes_differing": codes, "scales_differing": scales})
                if codes or scales:
                    mismatched.append(name)
    compiled_rows: list[dict[str, Any]] | str = "skipped on the CPU (the rehearsal keeps to the eager path)"
    if compiled:
        compiled_rows = []
        for gran, fmt in (("tensor", "e4m3"), ("block_1x128", "e4m3")):
            t = inputs["x"].to(torch.bfloat16)
            ref = quantize(t, fmt, gran)
            got = quantize(t.to(device), fmt, gran, compile=True)
            codes = (ref.data.view(torch.uint8) != got.data.cpu().view(torch.uint8)).sum().item()
            scales = (ref.scale.view(torch.int32) != got.scale.cpu().view(torch.int32)).sum().item()
            compiled_rows.append(
                {"case": f"compiled {gran} {fmt} bfloat16", "codes_differing": codes, "scales_differing": scales}
            )
            if codes or scales:
                mismatched.append(f"compiled {gran}")
    checks = [
        check(
            f"{len(rows)} eager quantizations equal the CPU's bit for bit",
            not [m for m in mismatched if not m.startswith("compiled")],
        )
    ]
    if compiled:
        checks.append(
            check(
                "compiled quantizer equals the CPU's eager one bit for bit",
                not [m for m in mismatched if m.startswith("compiled")],
            )
        )
    note = None if device == "cuda" else "no GPU: the CPU was compared with itself (the code ran; nothing was measured)"
    return {
        "device": device,
        "cases": rows,
        "compiled": compiled_rows,
        "mismatched": mismatched,
        "note": note,
        "checks": checks,
    }


# ---------------------------------------------------------------------------------------------- gemm
def accumulation_bound(k: int, out_dtype: torch.dtype) -> float:
    """Bound on |hardware - exact| / (|A| @ |B|^T) for a K-long reduction of exact FP8 products: the tensor cores'
    limited-precision partial sums (about 14 bits, promoted to FP32 at least every 128 products: DeepSeek-V3
    section 3.3.2) give at most 2^-7, FP32 accumulation (K + 6) 2^-24, and a BF16 output one more 2^-8."""
    return 2.0**-7 + (k + 6) * 2.0**-24 + (2.0**-8 if out_dtype == torch.bfloat16 else 0.0)


def emulator_bound(k: int) -> float:
    """fp8rl's FP32 GEMM of the same operands: FP32 accumulation, scales applied in FP32 (or FP32 dequantization
    of block operands)."""
    return (k + 8) * 2.0**-24


def relative_error(out: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor) -> float:
    return ((out.double() - exact).abs() / magnitude.clamp_min(1e-300)).max().item()


def gemm(device: str, m: int | None = None, k: int | None = None, n: int | None = None) -> dict[str, Any]:
    """Every recipe's three GEMMs on the hardware (where the device takes the scaling) vs FP64 of the same codes."""
    from fp8rl.quant import fp8_gemm

    if device == "cuda":
        m, k, n = m or 512, k or 4096, n or 1024
    else:
        m, k, n = m or 256, k or 512, n or 384
    x, w, dy = test_tensors(m, k, n, device)
    cap = capability()
    expected = {  # which recipes the hardware should take (ScaledBlas.cpp; blockwise: SM90 only, cuBLAS >= 12.9)
        "tensorwise": cap is not None and cap >= (8, 9),
        "rowwise": cap is not None and cap >= (8, 9),
        "blockwise": cap is not None and cap[0] == 9,
        "mxfp8": cap is not None and cap >= (10, 0),
    }
    table: dict[str, dict[str, Any]] = {}
    checks, findings = [], []
    for recipe_name in RECIPES:
        table[recipe_name] = {}
        for gemm_name, (qa, qb) in gemm_operands(recipe_name, x, w, dy).items():
            reduction = qa.data.shape[1]
            a64, b64 = exact_float64(qa), exact_float64(qb)
            exact, magnitude = a64 @ b64.t(), a64.abs() @ b64.abs().t()
            row: dict[str, Any] = {"reduction": reduction, "shape": [qa.data.shape[0], qb.data.shape[0]]}
            emulated = fp8_gemm(qa, qb, torch.float32)
            row["emulator_rel"] = relative_error(emulated, exact, magnitude)
            row["emulator_bound"] = emulator_bound(reduction)
            checks.append(
                check(
                    f"emulator {recipe_name} {gemm_name} within its bound", row["emulator_rel"] <= row["emulator_bound"]
                )
            )
            attempts = []
            for api in ("legacy", "v2"):
                for out_dtype in (torch.float32, torch.bfloat16):
                    try:
                        out = scaled_mm(qa, qb, out_dtype, api)
                        sync(device)
                    except Exception as err:  # noqa: BLE001 - refused: try the next form
                        attempts.append(f"{api} {str(out_dtype).removeprefix('torch.')}: " + error_text(err, 200))
                        continue
                    row["hardware"] = {
                        "api": api,
                        "out_dtype": str(out_dtype).removeprefix("torch."),
                        "rel": relative_error(out, exact, magnitude),
                        "bound": accumulation_bound(reduction, out_dtype),
                    }
                    if gemm_name == "fprop" and recipe_name in ("tensorwise", "rowwise"):
                        # torchao's recipes run fprop with use_fast_accum=True: its error, for the record
                        try:
                            fast = scaled_mm(qa, qb, out_dtype, api, fast_accum=True)
                            sync(device)
                            row["hardware"]["fast_accum_rel"] = relative_error(fast, exact, magnitude)
                        except Exception as err:  # noqa: BLE001 - recorded; the exact-accumulation result stands
                            row["hardware"]["fast_accum"] = "refused: " + error_text(err, 200)
                    break
                if "hardware" in row:
                    break
            if "hardware" in row:
                hw = row["hardware"]
                checks.append(
                    check(
                        f"hardware {recipe_name} {gemm_name} within the accumulation bound",
                        hw["rel"] <= hw["bound"],
                        rel=hw["rel"],
                        bound=hw["bound"],
                    )
                )
            else:
                row["hardware"] = {"refused": attempts}
                if device == "cuda" and expected[recipe_name]:
                    findings.append(f"{recipe_name} {gemm_name} refused on compute capability {cap}: {attempts[:1]}")
                    if recipe_name in ("tensorwise", "rowwise"):
                        checks.append(
                            check(f"hardware {recipe_name} {gemm_name} runs on compute capability {cap}", False)
                        )
            table[recipe_name][gemm_name] = row
    return {
        "device": device,
        "shape_mkn": [m, k, n],
        "allow_tf32": torch.backends.cuda.matmul.allow_tf32 if device == "cuda" else None,
        "expected_on_this_device": expected if device == "cuda" else None,
        "table": table,
        "findings": findings,
        "checks": checks,
    }


# ----------------------------------------------------------------------------------------- train step
def stack_shape(device: str, layers: int) -> Any:
    """Qwen3-8B's layer shapes (``layers`` of its 36) on a GPU; the tiny preset's for a CPU rehearsal."""
    import dataclasses

    from fp8rl.models.config import get_model_config

    base = get_model_config("qwen3_8b" if device == "cuda" else "tiny")
    return dataclasses.replace(base, num_layers=layers, name=f"{base.name}_{layers}layers")


def layer_stack(cfg: Any, device: str) -> torch.nn.Module:
    """Qwen3 decoder layers in plain torch (every GEMM an nn.Linear, so torchao's convert_to_float8_training swaps
    them): RMSNorm, fused QKV, QK-norm, causal GQA attention (SDPA), output projection, SwiGLU MLP; no RoPE (an
    elementwise op, no GEMM), no embedding or LM head."""
    import torch.nn.functional as F
    from torch import nn

    h, heads, groups, d, f = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_query_groups,
        cfg.kv_channels,
        cfg.ffn_hidden_size,
    )

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.RMSNorm(h, eps=cfg.norm_epsilon), nn.RMSNorm(h, eps=cfg.norm_epsilon)
            self.q_norm, self.k_norm = nn.RMSNorm(d, eps=cfg.norm_epsilon), nn.RMSNorm(d, eps=cfg.norm_epsilon)
            self.qkv = nn.Linear(h, (heads + 2 * groups) * d, bias=False)
            self.proj = nn.Linear(heads * d, h, bias=False)
            self.fc1 = nn.Linear(h, 2 * f, bias=False)
            self.fc2 = nn.Linear(f, h, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).split([heads * d, groups * d, groups * d], dim=-1)
            q = self.q_norm(q.view(b, s, heads, d)).transpose(1, 2)
            k = self.k_norm(k.view(b, s, groups, d)).transpose(1, 2)
            v = v.view(b, s, groups, d).transpose(1, 2)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.proj(attn.transpose(1, 2).reshape(b, s, heads * d))
            gate, up = self.fc1(self.norm2(x)).chunk(2, dim=-1)
            return x + self.fc2(F.silu(gate) * up)

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(cfg.num_layers))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    return Stack().to(device=device, dtype=torch.bfloat16)


def timed(fn: Callable[[], Any], device: str, repeats: int, warmup: int) -> float:
    """Median seconds of ``fn()`` after `warmup` calls (CUDA events on a GPU, wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


TORCHAO_RECIPES = ("tensorwise", "rowwise")
# ||stack(x) - x - (bf16 stack(x) - x)|| / ||bf16 stack(x) - x|| before any step: about 0.07 for both recipes on the
# tiny shapes in torchao's CPU emulation (random nn.Linear init); wrong scales or layouts give O(1).
UPDATE_BOUND = 0.25  # torchao 0.18 Float8LinearRecipeName: also "rowwise_with_gw_hp"


def train_step(
    device: str, layers: int = 4, seq: int = 4096, micro: int = 2, repeats: int = 5, compile_modes: tuple = ()
) -> dict[str, Any]:
    """BF16 vs torchao float8 training steps of the same stack, eager and compiled, ratios in this run."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise Skip(f"torchao is not importable ({err}); it comes with the GPU bundle") from err
    cap = capability()
    if device == "cuda" and (cap is None or cap < (8, 9)):
        raise Skip(f"compute capability {cap}: torchao float8 training needs 8.9+")
    if device == "cpu":
        layers, seq, micro, repeats = 2, 64, 2, 2
    modes = ("eager", "compiled") if device == "cuda" else ("eager",)
    if compile_modes:
        modes = compile_modes
    cfg = stack_shape(device, layers)
    base = layer_stack(cfg, device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(micro, seq, cfg.hidden_size, generator=gen).to(device=device, dtype=torch.bfloat16)
    seconds: dict[str, dict[str, float]] = {m: {} for m in modes}
    update_error: dict[str, dict[str, float]] = {m: {} for m in modes}  # vs BF16, before any step
    with torch.no_grad():
        reference = base(x).float() - x.float()  # what the stack adds to its input, in BF16
    for mode in modes:
        for recipe in ("bf16", *TORCHAO_RECIPES):
            model = copy.deepcopy(base)
            if recipe != "bf16":
                config = Float8LinearConfig.from_recipe_name(recipe)
                if device != "cuda":
                    object.__setattr__(config, "emulate", True)  # a frozen dataclass; torchao's CPU emulation
                convert_to_float8_training(model, config=config)
            if mode == "compiled":
                # Each recipe compiles afresh: the layers share one code object, and the recipes' graphs (plus the
                # first layer's input without grad) passed dynamo's recompile limit of 8, after which the last
                # recipe's layers ran eagerly (seen on the H200 in results/gpu/ as rowwise at 0.62x).
                torch._dynamo.reset()
                model.layers = torch.nn.ModuleList(torch.compile(layer) for layer in model.layers)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
            with torch.no_grad():
                update = model(x).float() - x.float()
                update_error[mode][recipe] = ((update - reference).norm() / reference.norm()).item()
                del update

            def step(model=model, optimizer=optimizer) -> None:
                loss = model(x).float().pow(2).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            seconds[mode][recipe] = timed(step, device, repeats, warmup=2)
            del model, optimizer, step
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    tokens = micro * seq
    speedup = {m: {r: seconds[m]["bf16"] / s for r, s in seconds[m].items()} for m in modes}
    checks = []
    for mode in modes:
        for recipe in TORCHAO_RECIPES:
            rel = update_error[mode][recipe]
            what = f"{mode} {recipe}: the stack's output update within {UPDATE_BOUND} of BF16's (relative norm)"
            checks.append(check(what, rel <= UPDATE_BOUND, rel=rel))
        checks.append(
            check(f"{mode}: every step timed", all(math.isfinite(s) and s > 0 for s in seconds[mode].values()))
        )
    if "compiled" in modes and "eager" in modes:
        speedup["compiled_bf16_over_eager_bf16"] = seconds["eager"]["bf16"] / seconds["compiled"]["bf16"]
    return {
        "device": device,
        "shape": {
            "layers": cfg.num_layers,
            "hidden": cfg.hidden_size,
            "heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_query_groups,
            "ffn": cfg.ffn_hidden_size,
            "seq": seq,
            "micro_batch": micro,
            "of": cfg.name,
        },
        "repeats": repeats,
        "seconds": seconds,
        "tokens_per_s": {m: {r: tokens / s for r, s in seconds[m].items()} for m in modes},
        "speedup_over_bf16": speedup,
        "update_error_vs_bf16": update_error,
        "torchao_emulated": device != "cuda",
        "note": "CPU rehearsal: torchao's float32 emulation on the tiny preset's shapes; the ratios are no GPU's"
        if device != "cuda"
        else "torchao float8 training (Float8LinearConfig.from_recipe_name); compiled = torch.compile per layer",
        "checks": checks,
    }


# -------------------------------------------------------------------------------------------------- rl
# The tiny tables' setting (sweeps/scale/tiny.yaml) and the demo's arms (sweeps/experiment/arm/{bf16,
# fp8_tensorwise,cc_tensorwise}.yaml) as dataclass overrides: the GPU image has no Hydra. tests/benchmarks checks
# they equal what fp8rl.compose builds from the YAML.
TINY_SCALE = {
    "algo.prompts_per_step": 8,
    "algo.num_minibatches": 2,
    "algo.lr": 2e-5,
    "clipping.interval": 5,
    "task.num_eval": 512,
    "eval.size": 512,
    "eval.bf16": True,
    "trainer.steps": 40,
    "trainer.checkpoint_every": 5,
}
RL_ARMS = {
    "bf16": {"clipping.rollout_correction": "tis_token"},
    "fp8_tensorwise": {
        "precision.mode": "fp8_full",
        "clipping.rollout_correction": "tis_token",
        "trainer.shadow_every": "interval",
    },
    "cc_tensorwise": {
        "precision.mode": "fp8_full",
        "clipping.policy": "calibrated",
        "clipping.rollout_correction": "tis_token",
        "clipping.pool_neg_tokens": 500,
    },
}
RL_INTERVAL = 2  # the demo's K: Calibrated Clipping calibrates within a few steps
RL_KEY_METRICS = (
    "rollout/reward",
    "rollout/response_len",
    "rollout/entropy",
    "rollout/abs_logp_diff",
    "actor/loss",
    "actor/grad_norm",
    "clip/low_neg",
    "clip/bound_low",
    "clip/bound_high",
    "train/tokens",
)
RL_STEP0_REWARD_TOLERANCE = 0.15


def rl_arm_overrides(arm: str, device: str, steps: int, interval: int = RL_INTERVAL) -> dict[str, Any]:
    arm_overrides = {k: (interval if v == "interval" else v) for k, v in RL_ARMS[arm].items()}
    return {
        **TINY_SCALE,
        **arm_overrides,
        "clipping.interval": interval,
        "trainer.steps": steps,
        "model.device": device,
        "tracking.enabled": False,
    }


def rl_arm_config(arm: str, device: str, steps: int, out_dir: str | None = None) -> Any:
    from fp8rl.choices import validated
    from fp8rl.config import RunConfig, with_overrides

    changes = rl_arm_overrides(arm, device, steps)
    if out_dir is not None:
        changes["trainer.out_dir"] = out_dir
    return validated(with_overrides(RunConfig(), changes))


def run_arm(arm: str, device: str, steps: int) -> dict[str, Any]:
    """`steps` RL steps of one arm in this process: per-step metrics (floats), the build and step times."""
    return run_config(rl_arm_config(arm, device, steps, tempfile.mkdtemp(prefix="fp8rl-gpu-rl-")), device, steps)


def run_config(cfg: Any, device: str, steps: int) -> dict[str, Any]:
    """`steps` RL steps of a validated RunConfig in this process: per-step metrics (floats), the build time."""
    from fp8rl.job import build_trainer

    t = time.perf_counter()
    trainer = build_trainer(cfg)
    built = time.perf_counter() - t
    history = []
    try:
        for step in range(steps):
            metrics = trainer.train_step(step).metrics
            history.append({k: float(v) for k, v in metrics.items() if isinstance(v, int | float)})
    finally:
        getattr(trainer.engine, "close", lambda: None)()
    del trainer
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"build_s": built, "steps": history}


def run_arms(device: str, steps: int) -> dict[str, Any]:
    return {arm: run_arm(arm, device, steps) for arm in RL_ARMS}


def cpu_arms_in_own_process(steps: int) -> dict[str, Any]:
    """The CPU half on a GPU host, in a process that sees no GPU (as on a CPU machine: megatron's CPU shims are
    set up only where torch finds no CUDA device)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        out = Path(fh.name)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import gpu_sections as s; "
        "json.dump(s.run_arms('cpu', int(sys.argv[2])), open(sys.argv[3], 'w'))"
    )
    subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(steps), str(out)], check=True, env=env)
    try:
        import json

        return json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)


def finite(history: list[dict[str, float]]) -> set[str]:
    """Keys with a non-finite value at some step."""
    return {k for metrics in history for k, v in metrics.items() if not math.isfinite(v)}


def compare_arms(gpu: dict[str, Any], cpu: dict[str, Any]) -> dict[str, Any]:
    """Per arm: the key metrics per step on both devices and their differences, the largest difference of every
    shared metric (time/* left out), and the keys that are non-finite on either."""
    out = {}
    for arm in RL_ARMS:
        g, c = gpu[arm]["steps"], cpu[arm]["steps"]
        per_step = []
        for step, (gm, cm) in enumerate(zip(g, c, strict=True)):
            per_step.append(
                {
                    key: {
                        "cpu": cm.get(key),
                        "gpu": gm.get(key),
                        "diff": None if key not in gm or key not in cm else gm[key] - cm[key],
                    }
                    for key in RL_KEY_METRICS
                }
                | {"step": step}
            )
        shared = sorted(set().union(*g) & set().union(*c))
        largest = {}
        for key in shared:
            if key.startswith("time/"):
                continue
            diffs = [abs(gm[key] - cm[key]) for gm, cm in zip(g, c, strict=True) if key in gm and key in cm]
            finite_diffs = [d for d in diffs if math.isfinite(d)]
            largest[key] = max(finite_diffs) if finite_diffs else None
        identical = sorted(k for k, v in largest.items() if v == 0.0)
        out[arm] = {
            "per_step": per_step,
            "largest_difference": largest,
            "identical_metrics": identical,
            "nonfinite_gpu": sorted(finite(g)),
            "nonfinite_cpu": sorted(finite(c)),
            "step_time_s": {
                "gpu": statistics.median(m["time/step"] for m in g) if g and "time/step" in g[0] else None,
                "cpu": statistics.median(m["time/step"] for m in c) if c and "time/step" in c[0] else None,
            },
        }
    return out


RL_EXPECTED = (
    "Not bit-identical, by design: both devices start from the same shipped warm start and draw the same per-row "
    "sampling uniforms (on the CPU, fp8rl.models.generate.row_uniforms), but BF16 GEMMs and reductions round "
    "differently in cuBLAS and on the CPU. A sampled token flips only where its uniform falls within that round-off "
    "of a CDF boundary, so step 0's rollouts and rewards should nearly agree (a check: reward within "
    f"{RL_STEP0_REWARD_TOLERANCE}), log-prob metrics differ at BF16 round-off, and the trajectories drift apart "
    "with every update."
)


def rl(device: str, steps: int = 4) -> dict[str, Any]:
    """The three arms on the GPU (when there is one) and on the CPU, compared."""
    try:
        import math_verify  # noqa: F401
        import megatron.core  # noqa: F401
    except ImportError as err:
        raise Skip(
            f"the trainer's stack is missing ({err}); megatron-core and math-verify come with the GPU bundle"
        ) from err
    if device == "cuda":
        gpu = run_arms("cuda", steps)
        cpu = cpu_arms_in_own_process(steps)
        comparison = compare_arms(gpu, cpu)
        checks = []
        for arm, comp in comparison.items():
            checks.append(
                check(
                    f"{arm}: {steps} steps on both devices", len(gpu[arm]["steps"]) == len(cpu[arm]["steps"]) == steps
                )
            )
            checks.append(
                check(
                    f"{arm}: the same metrics are non-finite on both devices",
                    comp["nonfinite_gpu"] == comp["nonfinite_cpu"],
                    gpu=comp["nonfinite_gpu"],
                    cpu=comp["nonfinite_cpu"],
                )
            )
            diff = comp["per_step"][0]["rollout/reward"]["diff"]
            checks.append(
                check(
                    f"{arm}: step 0 mean reward within {RL_STEP0_REWARD_TOLERANCE} of the CPU's",
                    diff is not None and abs(diff) <= RL_STEP0_REWARD_TOLERANCE,
                    diff=diff,
                )
            )
        return {
            "device": "cuda",
            "steps": steps,
            "arms": list(RL_ARMS),
            "comparison": comparison,
            "expected": RL_EXPECTED,
            "gpu": gpu,
            "cpu": cpu,
            "checks": checks,
        }
    cpu = run_arms("cpu", steps)
    checks = [
        check(
            f"{arm}: {steps} steps, every metric finite",
            len(cpu[arm]["steps"]) == steps and not finite(cpu[arm]["steps"]),
            nonfinite=sorted(finite(cpu[arm]["steps"])),
        )
        for arm in RL_ARMS
    ]
    return {
        "device": "cpu",
        "steps": steps,
        "arms": list(RL_ARMS),
        "gpu": "skipped: no CUDA device",
        "cpu": cpu,
        "expected": RL_EXPECTED,
        "checks": checks,
    }


# ------------------------------------------------------------------------------------------- torchao_rl
TORCHAO_RL_STEPS = 3


def torchao_arm_config(recipe: str, backend: str, device: str, steps: int) -> Any:
    """The tiny tables' vanilla FP8 arm of `recipe` (token TIS) on `backend` ("torchao" or "emulated")."""
    from fp8rl.choices import validated
    from fp8rl.config import RunConfig, with_overrides

    changes = {
        **TINY_SCALE,
        "precision.mode": "fp8_full",
        "precision.recipe": recipe,
        "precision.backend": backend,
        "clipping.rollout_correction": "tis_token",
        "trainer.steps": steps,
        "trainer.out_dir": tempfile.mkdtemp(prefix="fp8rl-gpu-torchao-"),
        "model.device": device,
        "tracking.enabled": False,
    }
    return validated(with_overrides(RunConfig(), changes))


def torchao_padding_probe(device: str, rows: int = 100) -> dict[str, str]:
    """Forward and backward of fp8rl's torchao GEMM with `rows` tokens (not a multiple of 16), the inner dimension
    padded to 16 or not: "ran" or the error, per recipe. On the CPU (emulation) nothing is padded or probed."""
    if device != "cuda":
        return {"note": "the CPU runs torchao's emulation, which needs no padding"}
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    from fp8rl.models.te_recipes import to_torchao_config

    out = {}
    gen = torch.Generator().manual_seed(0)
    for recipe in TORCHAO_RECIPES:
        config = to_torchao_config(recipe)
        gemms = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
        for pad in (False, True):
            x = torch.randn(rows, 256, generator=gen).to(device, torch.bfloat16).requires_grad_()
            w = torch.randn(512, 256, generator=gen).to(device, torch.bfloat16).requires_grad_()
            mm = LinearMMConfig(*(ScaledMMConfig(False, g.use_fast_accum, False, pad) for g in gemms))
            try:
                matmul_with_hp_or_float8_args.apply(x, w.t(), mm, config).float().pow(2).mean().backward()
                torch.cuda.synchronize()
                out[f"{recipe}, pad_inner_dim={pad}"] = "ran (forward, dgrad, wgrad)"
            except Exception as err:  # the refusal's text is the finding
                out[f"{recipe}, pad_inner_dim={pad}"] = "refused: " + error_text(err)
    return out


def torchao_rl(device: str, steps: int = TORCHAO_RL_STEPS) -> dict[str, Any]:
    """fp8rl's torchao backend against its emulated backend, arm by arm on the same device (the CPU rehearsal: one
    step each, torchao's emulation)."""
    try:
        import math_verify  # noqa: F401
        import megatron.core  # noqa: F401
        import torchao.float8  # noqa: F401
    except ImportError as err:
        raise Skip(f"the trainer's stack or torchao is missing ({err}); they come with the GPU bundle") from err
    from fp8rl.models.te_recipes import torchao_pads_inner_dim

    if device != "cuda":
        steps = 1
    padding = torchao_padding_probe(device)
    runs: dict[str, Any] = {}
    for recipe in TORCHAO_RECIPES:
        for backend in ("torchao", "emulated"):
            try:
                runs[f"{recipe}/{backend}"] = run_config(
                    torchao_arm_config(recipe, backend, device, steps), device, steps
                )
            except Exception as err:  # one arm's failure is reported; the others still run
                runs[f"{recipe}/{backend}"] = {"error": error_text(err), "traceback": traceback.format_exc()[-3000:]}
    comparison, checks = {}, []
    for recipe in TORCHAO_RECIPES:
        ao, em = runs[f"{recipe}/torchao"], runs[f"{recipe}/emulated"]
        ran = "steps" in ao and len(ao["steps"]) == steps
        checks.append(check(f"{recipe}: the torchao backend ran {steps} RL steps", ran, error=ao.get("error")))
        if not ran or "steps" not in em:
            continue
        checks.append(
            check(
                f"{recipe}: every torchao metric finite", not finite(ao["steps"]), nonfinite=sorted(finite(ao["steps"]))
            )
        )
        diff = ao["steps"][0]["rollout/reward"] - em["steps"][0]["rollout/reward"]
        checks.append(
            check(
                f"{recipe}: step 0 mean reward within {RL_STEP0_REWARD_TOLERANCE} of the emulated backend's",
                abs(diff) <= RL_STEP0_REWARD_TOLERANCE,
                diff=diff,
            )
        )
        comparison[recipe] = {
            "per_step": [
                {key: {"torchao": a.get(key), "emulated": e.get(key)} for key in RL_KEY_METRICS} | {"step": i}
                for i, (a, e) in enumerate(zip(ao["steps"], em["steps"], strict=False))
            ],
            "step_time_s": {
                name: statistics.median(m["time/step"] for m in run["steps"])
                if "time/step" in run["steps"][0]
                else None
                for name, run in (("torchao", ao), ("emulated", em))
            },
        }
    if device == "cuda":
        needed = any(v.startswith("refused") for k, v in padding.items() if k.endswith("False"))
        padded_ran = all(v.startswith("ran") for k, v in padding.items() if k.endswith("True"))
        checks.append(check("the padded torchao GEMMs ran with 100 tokens", padded_ran))
        checks.append(
            check(
                "fp8rl pads the real GEMMs' inner dimension where unpadded ones are refused",
                torchao_pads_inner_dim(False) or not needed,
                unpadded_refused=needed,
            )
        )
    return {
        "device": device,
        "steps": steps,
        "padding": padding,
        "comparison": comparison,
        "runs": runs,
        "expected": "Same device, same start, same sampling uniforms: the engines differ by the GEMM (torchao's "
        "torch._scaled_mm with FP32 accumulation on a GPU vs the emulator's FP8-rounded operands in a BF16 GEMM), so "
        "step 0's rollouts nearly agree and the runs drift apart with each update.",
        "checks": checks,
    }
