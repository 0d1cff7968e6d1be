"""The GPU policy: megatron's Transformer Engine layer spec, TE FP8 recipes, Megatron DDP + optimizer.

The same `ModelConfig` and weights as the CPU path (`fp8rl.models.gpt`); what changes on a GPU host:

- layer spec: ``get_gpt_layer_with_transformer_engine_spec`` (TE linears with the pre-norms fused into
  QKV and FC1: `local_to_te_state_dict` renames the two norm weights, nothing else changes);
- FP8: the run's recipe set on the TransformerConfig (``fp8`` = "e4m3" or "hybrid", ``fp8_recipe`` =
  tensorwise / delayed / blockwise / mxfp8, the same names as `fp8rl.models.te_recipes`); Megatron's
  TransformerBlock enters TE's FP8 autocast per layer from it. `te_fp8(model, recipe)` switches the
  recipe for one pass (BF16 shadow passes set None), as `fp8_autocast` does for the emulator;
- parallelism from the run's layout (`fp8rl.models.parallel`): tensor/pipeline model parallel groups,
  sequence parallel when TP > 1, full activation recompute;
- BF16 parameters with FP32 main gradients in Megatron's DDP, Megatron's (distributed) Adam with FP32
  master weights (`policy_optimizer`).

Everything imports megatron's TE pieces and Transformer Engine lazily: this module imports on a CPU-only
host, calling it needs CUDA and transformer_engine. Verified where: the state-dict renaming and the
TransformerConfig mapping are tested on CPU (tests/models/test_te_backend.py); the model, FP8 passes,
DDP and optimizer are exercised by GPU-marked tests (tests/models/test_te_backend.py::*gpu*,
tests/trainer/test_gpu_step.py) and benchmarks/gpu_check.sh, which have not run on a GPU from this
repository yet (no GPU was lent to the sessions that wrote it).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from fp8rl.models.config import ModelConfig
from fp8rl.models.parallel import ParallelLayout
from fp8rl.quant import Fp8Recipe, get_recipe

# local spec name -> TE spec name (TE fuses each pre-norm into the linear that reads it)
LOCAL_TO_TE = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}


def local_to_te_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a local-spec state dict (CPU model, warm start) for the TE spec; `_extra_state` keys dropped."""
    return _rename_suffixes(state, LOCAL_TO_TE)


def te_to_local_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `local_to_te_state_dict` (for export, HF mapping and the CPU tools)."""
    return _rename_suffixes(state, {te: local for local, te in LOCAL_TO_TE.items()})


def _rename_suffixes(state: dict[str, torch.Tensor], renames: dict[str, str]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        if key.endswith("_extra_state"):
            continue
        old = next((o for o in renames if key.endswith("." + o)), None)
        out[key if old is None else key[: -len(old)] + renames[old]] = value
    return out


def load_local_weights(te_model: torch.nn.Module, local_state: dict[str, torch.Tensor]) -> None:
    """Load a local-spec state dict (warm start, HF import, checkpoint) into a TE-spec model, in BF16.

    Strict about real tensors: only TE's ``_extra_state`` entries may be missing, nothing may be left over."""
    state = local_to_te_state_dict(local_state)
    result = te_model.load_state_dict({k: v.to(torch.bfloat16) for k, v in state.items()}, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"weights do not fit the Transformer Engine model: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )


def te_fp8_fields(recipe: Fp8Recipe | str | None) -> dict[str, Any]:
    """TransformerConfig fields for `recipe` (None = BF16): ``fp8`` and ``fp8_recipe``."""
    if recipe is None:
        return {"fp8": None}
    recipe = get_recipe(recipe)
    if recipe.name == "rowwise":
        raise ValueError(
            "precision.recipe=rowwise has no Transformer Engine recipe; on GPU use tensorwise, blockwise or mxfp8 "
            "(or precision.backend=emulated)"
        )
    name = "delayed" if recipe.name == "tensorwise" and recipe.scaling == "delayed" else recipe.name
    return {"fp8": "hybrid" if recipe.fmt == "hybrid" else "e4m3", "fp8_recipe": name}


def te_transformer_config(model_cfg: ModelConfig, layout: ParallelLayout, recipe: Fp8Recipe | str | None):
    """megatron TransformerConfig for the TE spec: the CPU config plus parallelism, BF16 and FP8 fields."""
    from fp8rl.models.gpt import transformer_config

    base = transformer_config(model_cfg)
    fields = {
        "tensor_model_parallel_size": layout.tensor_parallel,
        "pipeline_model_parallel_size": layout.pipeline_parallel,
        "sequence_parallel": layout.tensor_parallel > 1,
        "bf16": True,
        "params_dtype": torch.bfloat16,
        "pipeline_dtype": torch.bfloat16,
        **te_fp8_fields(recipe),
    }
    if layout.activation_recompute:
        fields.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return dataclasses.replace(base, **fields)


def init_model_parallel(layout: ParallelLayout, seed: int) -> None:
    """Megatron's TP/PP groups over the already initialized torch.distributed world, and its CUDA RNG."""
    from megatron.core import parallel_state, tensor_parallel

    if not torch.distributed.is_initialized():
        if layout.world_size > 1:
            raise RuntimeError(
                "torch.distributed is not initialized: call fp8rl.launch.distributed.init_distributed first"
            )
        from fp8rl.models.cpu_compat import init_single_process_group

        init_single_process_group()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tensor_parallel, pipeline_model_parallel_size=layout.pipeline_parallel
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_te_gpt_model(model_cfg: ModelConfig, layout: ParallelLayout, recipe, seed: int = 0):
    """A GPTModel with the TE layer spec on the current CUDA device (BF16 parameters)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    init_model_parallel(layout, seed)
    config = te_transformer_config(model_cfg, layout, recipe)
    spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model_cfg.qk_layernorm)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=model_cfg.vocab_size,
        max_sequence_length=model_cfg.max_seq_len,
        share_embeddings_and_output_weights=model_cfg.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=model_cfg.rotary_base,
    )
    model.fp8rl_backend = "te"
    return model.cuda()


@contextlib.contextmanager
def te_fp8(model: torch.nn.Module, recipe: Fp8Recipe | str | None) -> Iterator[None]:
    """Run the TE model's passes in `recipe` (None = BF16) inside the block, then restore its config."""
    config = unwrap(model).config
    saved = {"fp8": config.fp8, "fp8_recipe": config.fp8_recipe}
    for key, value in te_fp8_fields(recipe).items():
        setattr(config, key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(config, key, value)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside Megatron's DDP wrapper (or the model itself)."""
    return getattr(model, "module", model)


def is_te_model(model: torch.nn.Module) -> bool:
    return getattr(unwrap(model), "fp8rl_backend", None) == "te"


def policy_optimizer(model: torch.nn.Module, layout: ParallelLayout, lr: float, weight_decay: float):
    """Megatron DDP (FP32 main grads) around `model` and Megatron's Adam (FP32 master weights)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=layout.distributed_optimizer
    )
    ddp_model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        weight_decay=weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.999,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=layout.distributed_optimizer,
        clip_grad=0.0,
    )
    return ddp_model, get_megatron_optimizer(opt_config, [ddp_model])


def gather_vocab_parallel(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits from TP-sharded ones (identity when TP = 1)."""
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return logits
    return tensor_parallel.gather_from_tensor_model_parallel_region(logits)
