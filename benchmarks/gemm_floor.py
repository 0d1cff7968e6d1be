"""The GEMM floor of each FP8 recipe's emulation on this CPU: which dtype its GEMMs must run in to stay
bit-identical, and what that dtype costs against the BF16 step's bf16 GEMMs (issue 29).

The emulator multiplies FP8 operands exactly (fp8rl/quant/linear.py): outer-scaled recipes (tensorwise,
rowwise) and block recipes with power-of-two scales (MXFP8) run their GEMMs in the compute dtype (bf16), where
the FP8 values or the dequantized values are exact; block recipes with FP32 scales (TorchAO's blockwise
preset) dequantize to float32 (e4m3 x an fp32 scale is not exact in bf16) and so run float32 GEMMs. A faster
GEMM for them (bf16 inputs, or per-block partial GEMMs) would change the values or the accumulation order: not
bit-identical. The GEMM dtype of each recipe is read from the emulator's own `gemm_input`, not assumed.

Timed: the three GEMMs (forward, dgrad, wgrad) of the tiny preset's four linears (qkv 256 -> 768, proj
256 -> 256, fc1 256 -> 1536, fc2 768 -> 256) over M token rows, in bf16 and float32, round-robin (one pass
each per round, median of the rounds).

Usage: python benchmarks/gemm_floor.py [--rows 6144] [--rounds 15] [--out results.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import write_json  # noqa: E402

from fp8rl.quant import get_recipe, quantize  # noqa: E402
from fp8rl.quant.linear import gemm_input  # noqa: E402

LINEARS = {"qkv": (256, 768), "proj": (256, 256), "fc1": (256, 1536), "fc2": (768, 256)}  # (in, out)
RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8")


def gemm_dtype(recipe_name: str) -> torch.dtype:
    """The dtype the emulator's GEMMs take for this recipe's activations under bf16 autocast."""
    recipe = get_recipe(recipe_name)
    q = quantize(torch.randn(256, 256), recipe.forward_format, recipe.activation_granularity, recipe.uses_pow2_scales)
    return gemm_input(q, torch.bfloat16).dtype


def linear_gemms(rows: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The operand pairs of every linear's forward, dgrad and wgrad GEMM (a @ b)."""
    pairs = []
    for k, n in LINEARS.values():
        x, w, dy = torch.randn(rows, k, dtype=dtype), torch.randn(n, k, dtype=dtype), torch.randn(rows, n, dtype=dtype)
        pairs += [(x, w.t()), (dy, w), (dy.t(), x)]
    return pairs


def time_pass(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    start = time.perf_counter()
    for a, b in pairs:
        a @ b
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=6144, help="token rows of a micro-batch")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    operands = {dtype: linear_gemms(args.rows, dtype) for dtype in (torch.bfloat16, torch.float32)}
    for pairs in operands.values():
        time_pass(pairs)  # warm-up
    samples: dict[torch.dtype, list[float]] = {dtype: [] for dtype in operands}
    for _ in range(args.rounds):
        for dtype, pairs in operands.items():
            samples[dtype].append(time_pass(pairs))
    seconds = {str(dtype).removeprefix("torch."): statistics.median(s) for dtype, s in samples.items()}
    recipes = {}
    for name in RECIPES:
        dtype = str(gemm_dtype(name)).removeprefix("torch.")
        recipes[name] = {"gemm_dtype": dtype, "gemm_time_over_bf16": seconds[dtype] / seconds["bfloat16"]}
        print(f"{name:11s} GEMMs in {dtype:8s}: {recipes[name]['gemm_time_over_bf16']:.2f}x BF16's GEMM time")
    result = {
        "args": vars(args),
        "threads": torch.get_num_threads(),
        "seconds_per_pass": seconds,
        "recipes": recipes,
        "definitions": {
            "seconds_per_pass": "median over rounds of the 12 GEMMs (3 per linear) of one micro-batch",
            "gemm_time_over_bf16": "the recipe's GEMM dtype's pass time / bf16's (the BF16 step's GEMMs)",
        },
    }
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
