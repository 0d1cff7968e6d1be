"""Block linears that compute in FP8 when a recipe is set, and as megatron's otherwise.

The FP8 GEMMs come from one of two engines (``fp8_engine``, set for the whole model by `set_fp8_engine`):
"emulated" (fp8rl.quant's ``fp8_linear``, any device) or "torchao" (torchao 0.18's float8 training GEMMs,
`fp8rl.models.te_recipes.torchao_fp8_matmul`: ``torch._scaled_mm`` on a CUDA GPU, torchao's own emulation
elsewhere). torchao scales each operand itself: the emulator's TP amax reductions do not apply (each rank's
shard is scaled locally, as Transformer Engine's current scaling without sequence parallelism does).

megatron's local spec uses ``ColumnParallelLinear`` for ``linear_qkv`` / ``linear_fc1`` and
``RowParallelLinear`` for ``linear_proj`` / ``linear_fc2``. Both route the GEMM through
``_forward_impl(input, weight, bias=..., ...)``; overriding only that hook keeps every other part of
megatron's forward (bias handling, skip_bias_add, TP collectives around the GEMM) untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region


class Fp8SwitchableLinearMixin:
    """Adds ``fp8_recipe`` (None = megatron's own GEMM) to a megatron parallel linear."""

    fp8_recipe: Any = None  # an fp8rl.quant Fp8Recipe, or None for the high-precision GEMM
    fp8_scaling_state: Any = None  # this layer's DelayedScalingState (amax histories), made on first delayed use
    input_channel_scale: torch.Tensor | None = None  # fp8rl.models.outliers: GEMM sees (x * s) @ (W / s)^T
    fp8_amax_reduce: Callable[[str, torch.Tensor], torch.Tensor] | None = None  # see set_fp8_amax_reduction
    fp8_engine: str = "emulated"  # or "torchao" (module docstring); see set_fp8_engine

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.input_channel_scale is not None:
            scale = self.input_channel_scale.to(device=input.device)
            input, weight = input * scale.to(input.dtype), weight / scale.to(weight.dtype)
        if self.fp8_recipe is None:
            return super()._forward_impl(input, weight, *args, **kwargs)
        if args:
            raise TypeError("megatron passes the GEMM options by keyword; got positional ones")
        if kwargs.get("sequence_parallel"):
            raise NotImplementedError("emulated FP8 linears do not implement the sequence-parallel all-gather")
        if kwargs.get("allreduce_dgrad"):
            # megatron's fused GEMM all-reduces the input gradient across TP ranks; keep that.
            input = copy_to_tensor_model_parallel_region(input, group=kwargs.get("tp_group"))
        if self.fp8_engine == "torchao":
            from fp8rl.models.te_recipes import torchao_fp8_matmul

            device = input.device.type
            if torch.is_autocast_enabled(device):  # as torchao's Float8Linear.forward: the GEMM in autocast's dtype
                input = input.to(torch.get_autocast_dtype(device))
            out = torchao_fp8_matmul(input, weight, self.fp8_recipe, emulate=device != "cuda")
            bias = kwargs.get("bias")
            return out if bias is None else out + bias.to(out.dtype)
        from fp8rl.quant import DelayedScalingState, fp8_linear  # lazily: BF16-only runs never need the emulator

        if getattr(self.fp8_recipe, "scaling", "current") == "delayed" and self.fp8_scaling_state is None:
            self.fp8_scaling_state = DelayedScalingState(history_len=self.fp8_recipe.amax_history_len)
        return fp8_linear(
            input, weight, kwargs.get("bias"), self.fp8_recipe, self.fp8_scaling_state, self.fp8_amax_reduce
        )


class Fp8ColumnParallelLinear(Fp8SwitchableLinearMixin, ColumnParallelLinear):
    """``ColumnParallelLinear`` (linear_qkv, linear_fc1) with a switchable emulated-FP8 GEMM."""


class Fp8RowParallelLinear(Fp8SwitchableLinearMixin, RowParallelLinear):
    """``RowParallelLinear`` (linear_proj, linear_fc2) with a switchable emulated-FP8 GEMM."""


# Per-tensor (tensorwise) FP8 scales under tensor parallelism: which operands of a TP linear are one shard of
# a larger tensor, so that their local amax differs from the TP=1 tensor's:
#   column-parallel (linear_qkv, linear_fc1): W's rows and dy's columns are split, x is replicated;
#   row-parallel (linear_proj, linear_fc2): x's and W's columns are split, dy is replicated.
# "tp_invariant" reduces exactly those (TP=N then computes what TP=1 does); "te_current" reduces nothing:
# Transformer Engine's current scaling reduces amax over TP only for sequence-parallel-split operands (the column
# input, the row grad_output), which are replicated without sequence parallelism, the only layout the emulated
# linears support. Transformer Engine's delayed scaling reduces every amax over the amax-reduction group (TP x DP
# with megatron's defaults): pass that group and all three roles.
AMAX_REDUCTION_ROLES = {
    "tp_invariant": {"column": ("w", "dy"), "row": ("x", "w")},
    "te_current": {"column": (), "row": ()},
    "all": {"column": ("x", "w", "dy"), "row": ("x", "w", "dy")},
}


def make_amax_reducer(group, roles) -> Callable[[str, torch.Tensor], torch.Tensor] | None:
    """All-reduce MAX over `group` of the amax of the operands in `roles`; None when nothing is reduced."""
    if group is None or dist.get_world_size(group) == 1 or not roles:
        return None

    def reduce(role: str, amax: torch.Tensor) -> torch.Tensor:
        if role not in roles:
            return amax
        amax = amax.detach().float().clone()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        return amax

    return reduce


def set_fp8_amax_reduction(model: torch.nn.Module, policy: str | None, group=None) -> None:
    """Set every FP8-switchable linear's amax reduction: a policy of AMAX_REDUCTION_ROLES over its TP group
    (or `group`, e.g. megatron's amax-reduction group for delayed scaling); None = off."""
    for module in model.modules():
        if isinstance(module, Fp8SwitchableLinearMixin):
            if policy is None:
                module.fp8_amax_reduce = None
                continue
            kind = "column" if isinstance(module, ColumnParallelLinear) else "row"
            module.fp8_amax_reduce = make_amax_reducer(
                group if group is not None else module.tp_group, AMAX_REDUCTION_ROLES[policy][kind]
            )


FP8_ENGINES = ("emulated", "torchao")


def set_fp8_engine(model: torch.nn.Module, engine: str) -> int:
    """Make every FP8-switchable linear of `model` compute its FP8 GEMMs with `engine`; returns how many."""
    if engine not in FP8_ENGINES:
        raise ValueError(f"FP8 engine {engine!r}; valid: {list(FP8_ENGINES)}")
    linears = [m for m in model.modules() if isinstance(m, Fp8SwitchableLinearMixin)]
    for linear in linears:
        linear.fp8_engine = engine
    return len(linears)
