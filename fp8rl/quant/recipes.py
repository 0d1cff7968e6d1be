"""FP8 recipes for a linear layer: which granularity and format each GEMM operand uses.

A recipe name means the same thing everywhere in fp8rl: in this emulator, in the Transformer Engine
mapping (`fp8rl.models.te_recipes`) and in the vLLM engine's quantization settings.

Every GEMM of a linear layer is written ``A @ B^T`` with both operands laid out (rows, reduction);
each operand is scaled along its reduction dimension, as FP8 GEMM hardware requires:

    fprop  y  = x  @ W^T      A = x    (M, K)   B = W    (N, K)
    dgrad  dx = dy @ W        A = dy   (M, N)   B = W^T  (K, N)
    wgrad  dW = dy^T @ x      A = dy^T (N, M)   B = x^T  (K, M)

Each name's preset is the recipe of that name the paper trained with, TorchAO's (`RECIPE_PRESETS`; tests
compare them with torchao 0.18 itself), and MXFP8 is the OCP / Transformer Engine one:

| recipe     | activations | weights       | gradients   | grad format   | scale              | TorchAO / TE         |
|------------|-------------|---------------|-------------|---------------|--------------------|----------------------|
| tensorwise | tensor      | tensor        | tensor      | E5M2 (hybrid) | fp32, current      | TorchAO TENSORWISE   |
| rowwise    | row (1 x K) | row (1 x K)   | row         | E4M3          | power of two       | TorchAO ROWWISE      |
| blockwise  | block_1x128 | block_128x128 | block_1x128 | E4M3          | fp32               | TorchAO blockwise    |
| mxfp8      | mx_1x32     | mx_1x32       | mx_1x32     | E4M3          | E8M0 (pow2), RCEIL | TE MXFP8BlockScaling |

"e4m3" uses E4M3 for every operand; "hybrid" uses E5M2 for gradients (forward stays E4M3). Where TE's own
defaults differ they are one override away: TE's Float8BlockScaling uses power-of-two block scales
(``pow2_scale=True``; NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 is TorchAO's, verl's and NeMo-RL's FP32 choice);
TE's current and delayed scaling use the hybrid format, as TorchAO's tensorwise does.

One arithmetic difference remains: TE and TorchAO multiply by ``fmt_max / amax``, this emulator divides by
``amax / fmt_max``. With power-of-two scales the two are exact and equal; with float32 scales an element that
sits within a float32 rounding of an FP8 tie can round to the neighbouring code, and the scale's last bit
can differ (tests/quant/test_torchao_recipes.py measures both).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

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


# name: (fmt, pow2_scale) of the paper's recipe (TorchAO 0.18: Float8LinearConfig.from_recipe_name("tensorwise")
# has E5M2 grad_output casts, ...("rowwise") round_scales_to_power_of_2=True; its blockwise_fp8_training scales
# are 448 / amax in float32; MXFP8's E8M0 scales are powers of two by definition).
RECIPE_PRESETS: dict[str, tuple[str, bool]] = {
    "tensorwise": ("hybrid", False),
    "rowwise": ("e4m3", True),
    "blockwise": ("e4m3", False),
    "mxfp8": ("e4m3", True),
}


@dataclass(frozen=True)
class Fp8Recipe:
    """How a linear layer's three GEMMs quantize their operands; `fmt` and `pow2_scale` left at None take the
    name's preset (`RECIPE_PRESETS`)."""

    name: str  # "tensorwise" | "rowwise" | "blockwise" | "mxfp8"
    fmt: str | None = None  # "e4m3" everywhere, or "hybrid" (E5M2 gradients); None = the preset's
    scaling: str = "current"  # tensorwise only: "current" (amax of this tensor) or "delayed" (amax history)
    amax_history_len: int = 16  # delayed scaling: length of the amax history window
    amax_compute_algo: str = "max"  # delayed scaling: "max" over the history or "most_recent"
    margin: int = 0  # delayed scaling: scale divided by 2^margin for headroom
    pow2_scale: bool | None = None  # round scales up to powers of two (mxfp8 always); None = the preset's

    def __post_init__(self) -> None:
        if self.name not in RECIPE_NAMES:
            raise ValueError(f"unknown FP8 recipe {self.name!r}; valid recipes: {list(RECIPE_NAMES)}")
        preset_fmt, preset_pow2 = RECIPE_PRESETS[self.name]
        if self.fmt is None:
            object.__setattr__(self, "fmt", preset_fmt)
        if self.pow2_scale is None:
            object.__setattr__(self, "pow2_scale", preset_pow2)
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


def get_recipe(name: str | Fp8Recipe, fmt: str | None = None, **overrides: object) -> Fp8Recipe:
    """A recipe by name with its preset (the paper's, `RECIPE_PRESETS`) and any overrides (None = the preset)."""
    if isinstance(name, Fp8Recipe):
        changes = {k: v for k, v in {"fmt": fmt, **overrides}.items() if v is not None}
        return replace(name, **changes) if changes else name
    return Fp8Recipe(name=name, fmt=fmt, **overrides)  # type: ignore[arg-type]


def recipe_of(precision: Any) -> Fp8Recipe:
    """The recipe a precision config names (fp8rl.config.PrecisionConfig, read by field name: this module imports
    no config): the name's preset with the config's overrides and delayed-scaling settings."""
    p = precision
    return get_recipe(
        p.recipe,
        fmt=p.fmt,
        pow2_scale=p.pow2_scale,
        scaling=p.scaling,
        margin=p.margin,
        amax_history_len=p.amax_history_len,
        amax_compute_algo=p.amax_compute_algo,
    )


def legacy_pow2_scale(name: str) -> bool:
    """Before the presets were TorchAO's (runs published up to 9ac238a): power-of-two scales for blockwise and
    MXFP8 only; every format was E4M3 (`fmt` logged explicitly)."""
    return name in ("blockwise", "mxfp8")
