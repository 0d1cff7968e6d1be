"""megatron-core GPTModel from a :class:`ModelConfig`, with switchable emulated-FP8 block linears.

Weights are fp32 masters. Compute precision is chosen per forward, on the same weights:
``compute_precision("bf16")`` runs the block under bf16 autocast, and ``fp8_autocast(model, recipe)``
routes the four block linears (linear_qkv, linear_proj, linear_fc1, linear_fc2) through
``fp8rl.quant.fp8_linear``. The embedding, norms, attention core and output layer stay in the
autocast precision, as in Transformer Engine's FP8 recipes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from fp8rl.models.config import ModelConfig
from fp8rl.models.fp8_layers import Fp8ColumnParallelLinear, Fp8RowParallelLinear, Fp8SwitchableLinearMixin
from fp8rl.models.runtime import require_megatron, seed_megatron_rng

COMPUTE_PRECISIONS = ("fp32", "bf16")


def transformer_config(cfg: ModelConfig) -> TransformerConfig:
    """megatron ``TransformerConfig`` for ``cfg``: fp32 params, TP = PP = 1, no fused CUDA kernels."""
    on_gpu = torch.cuda.is_available()
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size,
        kv_channels=cfg.kv_channels,
        normalization=cfg.normalization,
        layernorm_epsilon=cfg.norm_epsilon,
        qk_layernorm=cfg.qk_layernorm,
        add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_qkv_bias,
        gated_linear_unit=cfg.swiglu,
        activation_func=F.silu if cfg.swiglu else F.gelu,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        init_method_std=cfg.init_std,
        params_dtype=torch.float32,
        use_cpu_initialization=not on_gpu,
        # The fused kernels below exist only as CUDA extensions (or need apex / TE).
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        attention_softmax_in_fp32=True,
    )


def fp8_switchable_layer_spec(cfg: ModelConfig) -> ModuleSpec:
    """megatron's local GPT layer spec with the four block linears swapped for FP8-switchable ones."""
    spec = get_gpt_layer_local_spec(qk_layernorm=cfg.qk_layernorm, normalization=cfg.normalization)
    layer = spec.submodules
    attention = layer.self_attention
    mlp = layer.mlp
    attention = dataclasses.replace(
        attention,
        submodules=dataclasses.replace(
            attention.submodules, linear_qkv=Fp8ColumnParallelLinear, linear_proj=Fp8RowParallelLinear
        ),
    )
    mlp = dataclasses.replace(
        mlp,
        submodules=dataclasses.replace(
            mlp.submodules, linear_fc1=Fp8ColumnParallelLinear, linear_fc2=Fp8RowParallelLinear
        ),
    )
    return dataclasses.replace(spec, submodules=dataclasses.replace(layer, self_attention=attention, mlp=mlp))


def build_gpt_model(cfg: ModelConfig, seed: int = 0) -> GPTModel:
    """A freshly initialized GPTModel for ``cfg`` (weights drawn from ``seed``; global RNG untouched).

    Needs megatron's process state (`fp8rl.models.runtime.init_megatron`).

    Forward: ``model(input_ids (b, s), position_ids (b, s), attention_mask (b, 1, s, s) bool, True =
    masked)`` -> logits (b, s, vocab_size). Use :mod:`fp8rl.models.logprobs` rather than calling it raw.
    """
    if cfg.vocab_size is None:
        raise ValueError(f"model {cfg.name!r} has no vocab_size yet; resolve it with with_tokenizer_vocab()")
    require_megatron()
    seed_megatron_rng(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPTModel(
            config=transformer_config(cfg),
            transformer_layer_spec=fp8_switchable_layer_spec(cfg),
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.max_seq_len,
            share_embeddings_and_output_weights=cfg.tie_embeddings,
            position_embedding_type="rope",
            rotary_base=cfg.rotary_base,
        )


def fp8_switchable_linears(model: torch.nn.Module) -> list[Fp8SwitchableLinearMixin]:
    """Every block linear of ``model`` whose GEMM can be switched to FP8."""
    return [module for module in model.modules() if isinstance(module, Fp8SwitchableLinearMixin)]


def _resolve_recipe(recipe: Any) -> Any:
    if isinstance(recipe, str):
        from fp8rl.quant import get_recipe

        return get_recipe(recipe)
    return recipe


def set_fp8_recipe(model: torch.nn.Module, recipe: Any) -> None:
    """Route every block linear through ``fp8_linear`` with ``recipe`` (an Fp8Recipe or its name); None = off."""
    linears = fp8_switchable_linears(model)
    if not linears:
        raise ValueError("model has no FP8-switchable linears; build it with build_gpt_model()")
    resolved = _resolve_recipe(recipe)
    for linear in linears:
        linear.fp8_recipe = resolved


@contextlib.contextmanager
def fp8_autocast(model: torch.nn.Module, recipe: Any) -> Iterator[None]:
    """Set ``recipe`` (None = high precision) on the block linears for the block, then restore each one's own.

    (A Transformer Engine model switches its TE recipe instead: `fp8rl.models.autocast.fp8_recipe_block`.)"""
    linears = fp8_switchable_linears(model)
    previous = [linear.fp8_recipe for linear in linears]
    set_fp8_recipe(model, recipe)
    try:
        yield
    finally:
        for linear, recipe_before in zip(linears, previous, strict=True):
            linear.fp8_recipe = recipe_before


def compute_precision(name: str) -> contextlib.AbstractContextManager:
    """Context for the non-FP8 compute: "fp32" (nothing) or "bf16" (autocast on the current device).

    Master weights stay fp32 either way; only the matmuls (and what autocast lists) run in bf16.
    """
    if name == "fp32":
        return contextlib.nullcontext()
    if name == "bf16":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    raise ValueError(f"unknown compute precision {name!r}; valid: {COMPUTE_PRECISIONS}")


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
