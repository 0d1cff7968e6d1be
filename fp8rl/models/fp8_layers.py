"""Block linears that compute in emulated FP8 when a recipe is set, and as megatron's otherwise.

megatron's local spec uses ``ColumnParallelLinear`` for ``linear_qkv`` / ``linear_fc1`` and
``RowParallelLinear`` for ``linear_proj`` / ``linear_fc2``. Both route the GEMM through
``_forward_impl(input, weight, bias=..., ...)``; overriding only that hook keeps every other part of
megatron's forward (bias handling, skip_bias_add, TP collectives around the GEMM) untouched.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region


class Fp8SwitchableLinearMixin:
    """Adds ``fp8_recipe`` (None = megatron's own GEMM) to a megatron parallel linear."""

    fp8_recipe: Any = None  # an fp8rl.quant Fp8Recipe, or None for the high-precision GEMM
    fp8_scaling_state: Any = None  # this layer's DelayedScalingState (amax histories), made on first delayed use
    input_channel_scale: torch.Tensor | None = None  # fp8rl.models.outliers: GEMM sees (x * s) @ (W / s)^T

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
        from fp8rl.quant import DelayedScalingState, fp8_linear  # lazily: BF16-only runs never need the emulator

        if getattr(self.fp8_recipe, "scaling", "current") == "delayed" and self.fp8_scaling_state is None:
            self.fp8_scaling_state = DelayedScalingState(history_len=self.fp8_recipe.amax_history_len)
        return fp8_linear(input, weight, kwargs.get("bias"), self.fp8_recipe, self.fp8_scaling_state)


class Fp8ColumnParallelLinear(Fp8SwitchableLinearMixin, ColumnParallelLinear):
    """``ColumnParallelLinear`` (linear_qkv, linear_fc1) with a switchable emulated-FP8 GEMM."""


class Fp8RowParallelLinear(Fp8SwitchableLinearMixin, RowParallelLinear):
    """``RowParallelLinear`` (linear_proj, linear_fc2) with a switchable emulated-FP8 GEMM."""
