"""Map fp8rl recipes to Transformer Engine (GPU) and torchao recipe objects.

Lives beside the model (the GPU layer spec's backend), not in `fp8rl.quant`, which stays pure torch.

Imports Transformer Engine / torchao lazily inside the functions: this module is importable on a
CPU-only host, and only calling the mapping needs the GPU stack. What was verified where: the
mapping's class names and arguments are unit-tested on CPU (tests/models/test_te_recipes.py); parity
of TE's quantizers and GEMMs with the emulator is in GPU-marked tests (tests/quant/test_te_parity.py),
not yet run on a GPU.

| fp8rl recipe | Transformer Engine 2.x                                  | torchao (paper's trainer) |
|--------------|---------------------------------------------------------|---------------------------|
| tensorwise   | Float8CurrentScaling, or DelayedScaling (scaling="delayed") | "tensorwise"          |
| rowwise      | none: TE has no per-row recipe (refused with a message)  | "rowwise"                 |
| blockwise    | Float8BlockScaling (1x128 acts/grads, 128x128 weights)   | none                      |
| mxfp8        | MXFP8BlockScaling (needs compute capability 10.0+)       | none                      |
"""

from __future__ import annotations

from typing import Any

from fp8rl.quant.recipes import Fp8Recipe, get_recipe

# Minimum CUDA compute capability for each recipe on hardware.
MIN_COMPUTE_CAPABILITY: dict[str, tuple[int, int]] = {
    "tensorwise": (8, 9),
    "rowwise": (8, 9),
    "blockwise": (9, 0),
    "mxfp8": (10, 0),
}


def te_recipe_kwargs(recipe: Fp8Recipe | str) -> tuple[str, dict[str, Any]]:
    """The TE recipe class name and its keyword arguments (format given by name) for `recipe`."""
    recipe = get_recipe(recipe)
    fmt = "HYBRID" if recipe.fmt == "hybrid" else "E4M3"
    if recipe.name == "tensorwise" and recipe.scaling == "delayed":
        return "DelayedScaling", {
            "fp8_format": fmt,
            "margin": recipe.margin,
            "amax_history_len": recipe.amax_history_len,
            "amax_compute_algo": recipe.amax_compute_algo,
        }
    if recipe.name == "tensorwise":
        return "Float8CurrentScaling", {"fp8_format": fmt}
    if recipe.name == "blockwise":
        return "Float8BlockScaling", {"fp8_format": fmt}
    if recipe.name == "mxfp8":
        return "MXFP8BlockScaling", {"fp8_format": fmt}
    raise ValueError(
        f"FP8 recipe {recipe.name!r} has no Transformer Engine equivalent; on GPU use 'tensorwise', "
        "'blockwise' or 'mxfp8' with Transformer Engine, or the emulator (fp8rl.quant.fp8_linear)"
    )


def to_te_recipe(recipe: Fp8Recipe | str) -> Any:
    """Build the Transformer Engine recipe object for `recipe` (GPU hosts with transformer_engine)."""
    class_name, kwargs = te_recipe_kwargs(recipe)
    try:
        from transformer_engine.common import recipe as te_recipe
    except ImportError as err:  # pragma: no cover - exercised only without TE
        raise RuntimeError(
            "Transformer Engine is not installed (it needs CUDA): install the `gpu` extra on a GPU host, "
            "or use the CPU emulator"
        ) from err
    kwargs["fp8_format"] = getattr(te_recipe.Format, kwargs["fp8_format"])
    return getattr(te_recipe, class_name)(**kwargs)


def to_torchao_config(recipe: Fp8Recipe | str) -> Any:
    """torchao's Float8LinearConfig for the recipes torchao implements (tensorwise, rowwise)."""
    recipe = get_recipe(recipe)
    if recipe.name not in ("tensorwise", "rowwise"):
        raise ValueError(f"torchao float8 training has no {recipe.name!r} recipe; use 'tensorwise' or 'rowwise'")
    from torchao.float8 import Float8LinearConfig

    return Float8LinearConfig.from_recipe_name(recipe.name)


def check_hardware_supports(recipe: Fp8Recipe | str, capability: tuple[int, int] | None) -> None:
    """Raise a clear error when a GPU of `capability` cannot run `recipe` (None: no GPU)."""
    recipe = get_recipe(recipe)
    needed = MIN_COMPUTE_CAPABILITY[recipe.name]
    if capability is None:
        raise ValueError(
            f"FP8 recipe {recipe.name!r} on the GPU path needs a CUDA device of compute capability "
            f"{needed[0]}.{needed[1]}+, but none was found; set the emulated backend (CPU) instead"
        )
    if tuple(capability) < needed:
        raise ValueError(
            f"FP8 recipe {recipe.name!r} needs compute capability {needed[0]}.{needed[1]}+, this GPU has "
            f"{capability[0]}.{capability[1]}; choose "
            f"{[n for n, c in MIN_COMPUTE_CAPABILITY.items() if tuple(capability) >= c] or 'the emulator'}"
        )
