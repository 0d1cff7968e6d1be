"""FP8 recipes for a linear layer: which granularity and format each GEMM operand uses.

A recipe name means the same thing everywhere in fp8rl: in this emulator, in the Transformer Engine
mapping (`fp8rl.models.te_recipes`) and in the vLLM engine's quantization settings.

Every GEMM of a linear layer is written ``A @ B^T`` with both operands laid out (rows, reduction);
each operand is scaled along its reduction dimension, as FP8 GEMM hardware requires:

    fprop  y  = x  @ W^T      A = x    (M, K)   B = W    (N, K)
    dgrad  dx = dy @ W        A = dy   (M, N)   B = W^T  (K, N)
    wgrad  dW = dy^T @ x      A = dy^T (N, M)   B = x^T  (K, M)

| recipe     | activations | weights       | gradients   | scale                 | TE recipe                           |
|------------|-------------|---------------|-------------|-----------------------|-------------------------------------|
| tensorwise | tensor      | tensor        | tensor      | fp32, current/delayed | Float8CurrentScaling/DelayedScaling |
| rowwise    | row (1 x K) | row (1 x K)   | row         | fp32 (pow2 optional)  | none (torchao rowwise)              |
| blockwise  | block_1x128 | block_128x128 | block_1x128 | fp32, pow2 by default | Float8BlockScaling                  |
| mxfp8      | mx_1x32     | mx_1x32       | mx_1x32     | E8M0 (pow2)           | MXFP8BlockScaling                   |

"e4m3" uses E4M3 for every operand; "hybrid" uses E5M2 for gradients (forward stays E4M3).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

RECIPE_NAMES = ("tensorwise", "rowwise", "blockwise", "mxfp8")
FORMAT_MODES = ("e4m3", "hybrid")
SCALING_MODES = ("current", "delayed")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")

_OPERAND_GRANULARITY = {
    # name: (activation, weight, gradient)
    "tensorwise": ("tensor", "tensor", "tensor"),
    "rowwise": ("row", "row", "row"),
    "blockwise": ("block_1x128", "block_128x128", "block_1x128"),
    "mxfp8": ("mx_1x32", "mx_1x32", "mx_1x32"),
}


@dataclass(frozen=True)
class Fp8Recipe:
    """How a linear layer's three GEMMs quantize their operands."""

    name: str  # "tensorwise" | "rowwise" | "blockwise" | "mxfp8"
    fmt: str = "e4m3"  # "e4m3" everywhere, or "hybrid" (E5M2 gradients)
    scaling: str = "current"  # tensorwise only: "current" (amax of this tensor) or "delayed" (amax history)
    amax_history_len: int = 16  # delayed scaling: length of the amax history window
    amax_compute_algo: str = "max"  # delayed scaling: "max" over the history or "most_recent"
    margin: int = 0  # delayed scaling: scale divided by 2^margin for headroom
    pow2_scale: bool = False  # round scales up to powers of two (blockwise default True; mxfp8 always)

    def __post_init__(self) -> None:
        if self.name not in RECIPE_NAMES:
            raise ValueError(f"unknown FP8 recipe {self.name!r}; valid recipes: {list(RECIPE_NAMES)}")
        if self.fmt not in FORMAT_MODES:
            raise ValueError(f"unknown FP8 format mode {self.fmt!r}; valid: {list(FORMAT_MODES)}")
        if self.scaling not in SCALING_MODES:
            raise ValueError(f"unknown scaling {self.scaling!r}; valid: {list(SCALING_MODES)}")
        if self.scaling == "delayed" and self.name != "tensorwise":
            raise ValueError(f"delayed scaling exists only for the tensorwise recipe, not {self.name!r}")
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"amax_compute_algo must be one of {list(AMAX_COMPUTE_ALGOS)}")
        if self.amax_history_len < 1:
            raise ValueError("amax_history_len must be >= 1")

    @property
    def activation_granularity(self) -> str:
        return _OPERAND_GRANULARITY[self.name][0]

    @property
    def weight_granularity(self) -> str:
        return _OPERAND_GRANULARITY[self.name][1]

    @property
    def gradient_granularity(self) -> str:
        return _OPERAND_GRANULARITY[self.name][2]

    @property
    def forward_format(self) -> str:
        """Format of activations and weights: E4M3 in both modes."""
        return "e4m3"

    @property
    def backward_format(self) -> str:
        """Format of the output gradient: E5M2 in "hybrid", E4M3 otherwise."""
        return "e5m2" if self.fmt == "hybrid" else "e4m3"

    @property
    def uses_pow2_scales(self) -> bool:
        return self.pow2_scale or self.name == "mxfp8"


def get_recipe(name: str | Fp8Recipe, fmt: str = "e4m3", **overrides: object) -> Fp8Recipe:
    """Build a recipe by name with its documented defaults (blockwise: power-of-two scales, as TE)."""
    if isinstance(name, Fp8Recipe):
        return replace(name, **overrides) if overrides else name
    defaults: dict[str, object] = {"pow2_scale": name in ("blockwise", "mxfp8")}
    defaults.update(overrides)
    return Fp8Recipe(name=name, fmt=fmt, **defaults)  # type: ignore[arg-type]
