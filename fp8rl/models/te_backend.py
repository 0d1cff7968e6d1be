"""The GPU policy: megatron's Transformer Engine layer spec, TE FP8 recipes, Megatron DDP + optimizer.

The same `ModelConfig` and weights as the CPU path (`fp8rl.models.gpt`); what changes on a GPU host:

- layer spec: ``get_gpt_layer_with_transformer_engine_spec`` (TE linears with the pre-norms fused into
  QKV and FC1: `local_to_te_state_dict` renames the two norm weights, nothing else changes);
- attention over the trainer's padded batches (left-padded prompts, right-padded responses): packed THD
  sequences, see "Padding" below; `TEGPTModel.forward` accepts the trainer's call unchanged;
- FP8: the run's recipe set on the TransformerConfig (``fp8`` = "e4m3" or "hybrid", ``fp8_recipe`` =
  tensorwise / delayed / blockwise / mxfp8, and for delayed scaling the recipe's margin, amax history
  length and amax algorithm: `te_fp8_fields`); Megatron's TransformerBlock enters TE's FP8 autocast from
  it (megatron-core 0.16.1 fp8_utils.get_fp8_recipe builds the TE recipe object from exactly these fields).
  `te_fp8(model, recipe)` switches the recipe for one pass (BF16 shadow passes set None), as
  `fp8_autocast` does for the emulator;
- parallelism from the run's layout (`fp8rl.models.parallel`): tensor/pipeline model parallel groups,
  sequence parallel when TP > 1, full activation recompute;
- BF16 parameters with FP32 main gradients in Megatron's DDP, Megatron's (distributed) Adam with FP32
  master weights (`policy_optimizer`), with a constant loss scale of 1 so that inf/NaN gradients skip the
  step (without a grad scaler Megatron's BF16 optimizer never checks them);
- weights loaded into the TE model are checked: only TE's ``_extra_state`` (FP8 metadata) may be missing
  (`check_te_state_keys`; `TEGPTModel.load_state_dict` applies it even when called with strict=False).

Padding. megatron-core 0.16.1's TE spec builds self-attention with ``AttnMaskType.causal``
(models/gpt/gpt_layer_specs.py:277), and Transformer Engine uses the ``attention_mask`` argument "only
when attn_mask_type includes padding or arbitrary" (TE 2.9-2.11, attention/dot_product_attention/
dot_product_attention.py:161): the trainer's (b, 1, s, s) causal | key-is-pad mask would be ignored and
every real token would attend to the left pads before it. ``padding_causal`` with a (b, 1, 1, s) mask is no
fix: TE turns that mask into per-row lengths (utils.get_cu_seqlens, "cumulative sequence lengths") and the
cuDNN backend treats each row as tokens [0, length), i.e. right padding only (backends.py:1806), while the
flash-attention backend un-pads by index (backends.py:784): which one runs is TE's choice. So the batch is
packed instead (THD: no padding at all): each row's real tokens, back to back, with ``cu_seqlens``
(`pack_padded_batch`, `PackedSeqParams` with qkv_format="thd"); megatron then switches the mask type to
padding_causal itself (extensions/transformer_engine.py:1397-1404) and applies RoPE per sequence
(models/common/embeddings/rope_utils.py:178-247). Each query attends to the keys of its own row at or
before it, exactly the keys the local spec's causal | key-is-pad mask leaves open
(`packed_attention_mask` is that set in the padded coordinates; tests/models/test_te_backend.py checks
them equal on CPU, and that a RoPE attention over the packed batch equals the padded one at every real
token: RoPE scores depend on distances only, and a row's real tokens are contiguous). The local (CPU) spec
keeps the (b, 1, s, s) mask: megatron's local DotProductAttention has no THD path. The packed length is
padded to a multiple of 128 x TP with one extra fill sequence (sequence parallelism splits the tokens
across TP ranks; TE's blockwise FP8 quantizes 128-row blocks, Float8BlockQuantizer.is_quantizable).

Everything imports megatron's TE pieces and Transformer Engine lazily: this module imports on a CPU-only
host, calling the model functions needs CUDA and transformer_engine. Verified where: the state-dict
renaming and key check, the TransformerConfig and optimizer-config mapping, and the packing are tested
on CPU (tests/models/test_te_backend.py); the model, FP8 passes, DDP and optimizer are exercised by
GPU-marked tests (tests/models/test_te_backend.py::*gpu*, tests/trainer/test_gpu_step.py) and
benchmarks/gpu_check.sh, which have not run on a GPU from this repository yet (no GPU was lent to the
sessions that wrote it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fp8rl.models.config import ModelConfig
from fp8rl.models.parallel import ParallelLayout
from fp8rl.models.te_recipes import apply_te_recipe_env, check_backend_supports, check_gpu_environment
from fp8rl.quant import Fp8Recipe, get_recipe

# TransformerConfig fields `te_fp8_fields` sets (and `te_fp8` saves and restores).
TE_FP8_FIELDS = ("fp8", "fp8_recipe", "fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo")
# Packed (THD) token counts are padded to a multiple of this x TP (see the module docstring).
THD_PAD_MULTIPLE = 128

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
    """TransformerConfig fields for `recipe` (None = BF16): ``fp8``, ``fp8_recipe`` and, for delayed
    scaling, ``fp8_margin`` / ``fp8_amax_history_len`` / ``fp8_amax_compute_algo``.

    megatron-core 0.16.1 builds the TE recipe from these (fp8_utils.py:536-594): delayed ->
    ``TEDelayedScaling(margin=config.fp8_margin, amax_compute_algo=config.fp8_amax_compute_algo,
    amax_history_len=config.fp8_amax_history_len, ...)`` (extensions/transformer_engine.py:2217-2224); its
    defaults (margin 0, history 1, "most_recent": transformer_config.py:455-466) are not the recipe's, so a
    delayed recipe always sets all three. The current-scaling, blockwise and MXFP8 recipes take the format only; their
    power-of-two scale switch is an environment variable (`fp8rl.models.te_recipes.te_recipe_env`).
    Rowwise has no TE recipe: ValueError with what to change (`check_backend_supports`).
    """
    if recipe is None:
        return {"fp8": None}
    recipe = get_recipe(recipe)
    check_backend_supports(recipe, "te")
    fields: dict[str, Any] = {"fp8": "hybrid" if recipe.fmt == "hybrid" else "e4m3", "fp8_recipe": recipe.name}
    if recipe.scaling == "delayed":
        fields.update(
            fp8_recipe="delayed",
            fp8_margin=recipe.margin,
            fp8_amax_history_len=recipe.amax_history_len,
            fp8_amax_compute_algo=recipe.amax_compute_algo,
        )
    return fields


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
        # megatron's TE linears pass is_first_microbatch=True on their first forward only, then False
        # (extensions/transformer_engine.py:671-678, 0.16.1): TE then reuses the FP8 weight cast of that first
        # pass (module/base.py), and only megatron's pipeline schedules reset the flag. fp8rl's passes (rollout,
        # old log-probs, updates, shadow) would all use the first step's FP8 weights. With this field megatron
        # passes None: TE casts the current weights on every forward.
        "disable_parameter_transpose_cache": True,
        **te_fp8_fields(recipe),
    }
    if layout.activation_recompute:
        fields.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return dataclasses.replace(base, **fields)


def build_te_gpt_model(model_cfg: ModelConfig, layout: ParallelLayout, recipe, seed: int = 0):
    """A `TEGPTModel` (GPTModel with the TE layer spec) on the current CUDA device (BF16 parameters)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from fp8rl.models.runtime import require_megatron, seed_megatron_rng

    check_gpu_environment(recipe, "te")  # compute capability, CUDA and TE versions, with what to change
    apply_te_recipe_env(recipe)  # before anything imports transformer_engine.common.recipe
    require_megatron()  # the job initialised megatron with this layout (fp8rl.models.runtime.init_megatron)
    initialised = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )
    if initialised != (layout.tensor_parallel, layout.pipeline_parallel):
        raise RuntimeError(f"megatron runs TP x PP = {initialised}, the layout asks for {layout.describe()}")
    seed_megatron_rng(seed)
    config = te_transformer_config(model_cfg, layout, recipe)
    spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model_cfg.qk_layernorm)
    model = te_gpt_model_class()(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=model_cfg.vocab_size,
        max_sequence_length=model_cfg.max_seq_len,
        share_embeddings_and_output_weights=model_cfg.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=model_cfg.rotary_base,
    )
    model.thd_pad_multiple = THD_PAD_MULTIPLE * layout.tensor_parallel
    return model.cuda()


@contextlib.contextmanager
def te_fp8(model: torch.nn.Module, recipe: Fp8Recipe | str | None) -> Iterator[None]:
    """Run the TE model's passes in `recipe` (None = BF16) inside the block, then restore its config."""
    config = unwrap(model).config
    saved = {key: getattr(config, key) for key in TE_FP8_FIELDS}
    fields = te_fp8_fields(recipe)
    if recipe is not None and "transformer_engine.common.recipe" in sys.modules:
        apply_te_recipe_env(recipe)  # TE's power-of-two switches are per process: refuse a mismatch
    for key, value in fields.items():
        setattr(config, key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(config, key, value)


# ------------------------------------------------------------------------------------------- padding
@dataclass(frozen=True)
class PackedBatch:
    """A padded (b, s) batch as one THD sequence pack (see the module docstring).

    input_ids, position_ids: (1, T): each row's real tokens back to back (positions 0, 1, ... per row),
    then ``fill`` tokens (their own sequence, discarded). cu_seqlens: (n + 1,) int32 (n sequences,
    the fill one included when fill > 0); max_seqlen: the longest of them. index: (T - fill,) long, the
    flat position ``row * s + column`` of each packed real token. shape: (b, s).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    index: torch.Tensor
    shape: tuple[int, int]
    fill: int


def token_mask_from_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(b, s) bool, True = real token, from the trainer's masks.

    Accepts the (b, s) attention mask (1 = token) or the local spec's (b, 1, s, s) bool mask (True =
    masked) built as causal | key-is-pad (fp8rl.models.logprobs.causal_padding_mask): its last query row
    has no future keys, so that row is exactly key-is-pad.
    """
    if attention_mask.dim() == 2:
        return attention_mask.bool()
    if attention_mask.dim() == 4 and attention_mask.size(1) == 1 and attention_mask.size(2) == attention_mask.size(3):
        return ~attention_mask[:, 0, -1, :].bool()
    raise ValueError(
        f"attention mask of shape {tuple(attention_mask.shape)}: expected (b, s) with 1 = token or "
        "(b, 1, s, s) bool with True = masked (causal | key-is-pad)"
    )


def pack_padded_batch(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_to_multiple: int = 1, fill_id: int = 0
) -> PackedBatch:
    """Pack a padded batch (b, s) (attention_mask: 1 = token) into one THD sequence pack.

    Each row's real tokens must be contiguous (left-padded prompt + right-padded response): RoPE then
    sees the same distances packed as padded. The pack is padded with ``fill_id`` tokens to a multiple of
    ``pad_to_multiple`` as one extra sequence; rows without tokens are left out.
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)}: need (b, s)"
        )
    batch, seq = input_ids.shape
    tokens = attention_mask.bool()
    lengths = tokens.sum(dim=1)
    first = tokens.int().argmax(dim=1)
    last = seq - 1 - tokens.int().flip(dims=[1]).argmax(dim=1)
    holes = (lengths > 0) & (last - first + 1 != lengths)
    if bool(holes.any()):
        raise ValueError(
            f"rows {holes.nonzero().flatten().tolist()} have padding between real tokens: packing would change "
            "their RoPE distances (the trainer's layout is left-padded prompt + right-padded response)"
        )
    index = tokens.flatten().nonzero().flatten()
    real = index.numel()
    if real == 0:
        raise ValueError("the batch has no real tokens")
    rows, cols = index // seq, index % seq
    positions = cols - first[rows]
    total = -(-real // pad_to_multiple) * pad_to_multiple
    fill = total - real
    segment_lengths = lengths[lengths > 0]
    if fill:
        segment_lengths = torch.cat([segment_lengths, segment_lengths.new_tensor([fill])])
    zero = torch.zeros(1, dtype=torch.int32, device=input_ids.device)
    cu_seqlens = torch.cat([zero, segment_lengths.cumsum(0).to(torch.int32)])
    packed_ids = torch.cat([input_ids.flatten()[index], input_ids.new_full((fill,), fill_id)])
    packed_pos = torch.cat([positions, torch.arange(fill, device=input_ids.device, dtype=positions.dtype)])
    return PackedBatch(
        input_ids=packed_ids[None],
        position_ids=packed_pos[None],
        cu_seqlens=cu_seqlens,
        max_seqlen=int(segment_lengths.max()),
        index=index,
        shape=(batch, seq),
        fill=fill,
    )


def unpack_packed(packed: PackedBatch, values: torch.Tensor) -> torch.Tensor:
    """(1, T, ...) outputs of a pack -> (b, s, ...) in the padded layout (zeros at pads; differentiable)."""
    flat = values[0, : packed.index.numel()]
    out = flat.new_zeros((packed.shape[0] * packed.shape[1], *flat.shape[1:]))
    return out.index_copy(0, packed.index, flat).view(*packed.shape, *flat.shape[1:])


def packed_seq_params(packed: PackedBatch) -> Any:
    """megatron's PackedSeqParams (qkv_format="thd") for `packed`: self-attention, no per-sequence padding."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=packed.cu_seqlens,
        cu_seqlens_kv=packed.cu_seqlens,
        max_seqlen_q=packed.max_seqlen,
        max_seqlen_kv=packed.max_seqlen,
    )


def packed_attention_mask(packed: PackedBatch) -> torch.Tensor:
    """The keys each query attends to in THD attention over `packed`, in the padded coordinates.

    (b, 1, s, s) bool, True = masked (the local spec's convention): query (r, i) sees key (r, j) iff both
    are real tokens of the same packed sequence and j is not after i; pad queries see nothing. For a CPU
    check against `fp8rl.models.logprobs.causal_padding_mask` (O(s^2) memory: small batches only).
    """
    batch, seq = packed.shape
    real = packed.index.numel()
    lengths = (packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]).long()
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)[:real]
    position = packed.position_ids[0, :real]
    allowed = (segment[:, None] == segment[None, :]) & (position[None, :] <= position[:, None])
    query, key = allowed.nonzero(as_tuple=True)
    rows, cols = packed.index // seq, packed.index % seq
    mask = torch.ones(batch, seq, seq, dtype=torch.bool, device=packed.index.device)
    mask[rows[query], cols[query], cols[key]] = False
    return mask[:, None]


def packed_forward(
    forward: Callable[..., torch.Tensor],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    pad_to_multiple: int = 1,
    **kwargs: Any,
) -> torch.Tensor:
    """``forward(ids (1, T), positions (1, T), None, packed_seq_params=..., **kwargs)`` over the pack of a
    padded batch, returned in the padded layout (b, s, ...). attention_mask: (b, s) 1 = token, or the
    (b, 1, s, s) causal | key-is-pad mask (`token_mask_from_attention_mask`)."""
    tokens = token_mask_from_attention_mask(attention_mask)
    packed = pack_padded_batch(input_ids, tokens, pad_to_multiple)
    out = forward(packed.input_ids, packed.position_ids, None, packed_seq_params=packed_seq_params(packed), **kwargs)
    return unpack_packed(packed, out)


def te_forward_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits (b, s, vocab) of a TE model for a padded batch, attention_mask (b, s) 1 = token.

    What `fp8rl.models.logprobs.forward_logits` should call for TE models: it skips building the O(s^2)
    (b, 1, s, s) mask that `TEGPTModel.forward` would otherwise reduce back to the (b, s) one.
    """
    return gather_vocab_parallel(model(input_ids, None, attention_mask.bool()))


_TE_GPT_MODEL: type | None = None


def te_gpt_model_class() -> type:
    """`TEGPTModel`: megatron's GPTModel taking the trainer's padded batches (made on first use)."""
    global _TE_GPT_MODEL
    if _TE_GPT_MODEL is None:
        from megatron.core.models.gpt import GPTModel

        class TEGPTModel(GPTModel):
            """GPTModel for the TE spec: padded batches run packed (THD), state loading checks its keys.

            ``forward(input_ids (b, s), position_ids, attention_mask)`` with attention_mask (b, s) 1 = token
            or (b, 1, s, s) True = masked (causal | key-is-pad) runs as `packed_forward` and returns
            (b, s, vocab / TP) logits, zeros at pads; with ``packed_seq_params`` given, no mask, or other
            arguments, it is megatron's forward unchanged.
            """

            fp8rl_backend = "te"
            thd_pad_multiple = THD_PAD_MULTIPLE

            def forward(self, input_ids, position_ids, attention_mask, *args, **kwargs):
                plain = (
                    args
                    or attention_mask is None
                    or input_ids is None
                    or any(kwargs.get(k) is not None for k in ("packed_seq_params", "decoder_input", "labels"))
                    or kwargs.get("inference_context") is not None
                    or kwargs.get("inference_params") is not None
                )
                if plain:
                    return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
                kwargs.pop("packed_seq_params", None)
                return packed_forward(
                    super().forward, input_ids, attention_mask, pad_to_multiple=self.thd_pad_multiple, **kwargs
                )

            def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
                result = super().load_state_dict(state_dict, strict=False, assign=assign)
                check_te_state_keys(result.missing_keys, result.unexpected_keys)
                return result

        _TE_GPT_MODEL = TEGPTModel
    return _TE_GPT_MODEL


def check_te_state_keys(missing: list[str], unexpected: list[str]) -> None:
    """Raise if loading left anything but TE's ``_extra_state`` (FP8 metadata) missing, or had extra keys."""
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(
            f"state dict does not match the TE model: missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected {list(unexpected)[:8]}{' ...' if len(unexpected) > 8 else ''} (a local-spec state dict "
            "needs local_to_te_state_dict first; only TE's _extra_state may be missing)"
        )


def load_te_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load `state` into a TE model (or its DDP wrapper) checking the keys (`check_te_state_keys`)."""
    result = unwrap(model).load_state_dict(state, strict=False)
    check_te_state_keys(result.missing_keys, result.unexpected_keys)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside Megatron's DDP wrapper (or the model itself)."""
    return getattr(model, "module", model)


def te_optimizer_config_kwargs(layout: ParallelLayout, lr: float, weight_decay: float) -> dict[str, Any]:
    """megatron OptimizerConfig arguments of `policy_optimizer` (a dict, testable without a GPU).

    ``loss_scale=1.0``: with bf16 and no loss scale, get_megatron_optimizer makes no grad scaler
    (megatron-core 0.16.1 optimizer/__init__.py:421-431: "otherwise we are running in bf16 with no
    loss-scale so leave it as None"), and MixedPrecisionOptimizer.prepare_grads checks inf/NaN only "if
    self.grad_scaler" (optimizer.py:538-557): step() would apply NaN gradients. A ConstantGradScaler(1.0)
    makes prepare_grads unscale by 1, find inf/NaN across the model-parallel ranks
    (_unscale_main_grads_and_check_for_nan, optimizer.py:496-521) and step() return (False, None, None)
    without touching the weights (optimizer.py:593-598; ChainedOptimizer.step alike, :1308-1311).
    ``clip_grad`` is set per step by the trainer (fp8rl.trainer.optim.MegatronPolicyOptimizer).
    """
    return {
        "optimizer": "adam",
        "lr": lr,
        "weight_decay": weight_decay,
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "bf16": True,
        "params_dtype": torch.bfloat16,
        "loss_scale": 1.0,
        "use_distributed_optimizer": layout.distributed_optimizer,
        "clip_grad": 0.0,
    }


def policy_optimizer(model: torch.nn.Module, layout: ParallelLayout, lr: float, weight_decay: float):
    """Megatron DDP (FP32 main grads) around `model` and Megatron's Adam (FP32 master weights); a step with
    inf/NaN gradients is skipped (`te_optimizer_config_kwargs`)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=layout.distributed_optimizer
    )
    ddp_model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    opt_config = OptimizerConfig(**te_optimizer_config_kwargs(layout, lr, weight_decay))
    return ddp_model, get_megatron_optimizer(opt_config, [ddp_model])


def gather_vocab_parallel(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits from TP-sharded ones (identity when TP = 1)."""
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return logits
    return tensor_parallel.gather_from_tensor_model_parallel_region(logits)
