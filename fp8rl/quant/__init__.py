"""FP8 numerics for fp8rl: formats, scaling granularities, recipes and an emulated FP8 linear layer.

Pure torch: imports nothing from the rest of fp8rl or any framework, so other projects can reuse it.
"""

from fp8rl.quant.formats import E4M3, E5M2, FORMATS, Fp8Format, get_format
from fp8rl.quant.granularity import GRANULARITIES
from fp8rl.quant.linear import DelayedScalingState, fp8_gemm, fp8_linear
from fp8rl.quant.recipes import RECIPE_NAMES, Fp8Recipe, get_recipe
from fp8rl.quant.tensor import Fp8Tensor, dequantize, fake_quantize, quantize

__all__ = [
    "E4M3",
    "E5M2",
    "FORMATS",
    "GRANULARITIES",
    "RECIPE_NAMES",
    "DelayedScalingState",
    "Fp8Format",
    "Fp8Recipe",
    "Fp8Tensor",
    "dequantize",
    "fake_quantize",
    "fp8_gemm",
    "fp8_linear",
    "get_format",
    "get_recipe",
    "quantize",
]
