"""The policy optimizer behind one small interface: torch AdamW (CPU, emulated FP8) or Megatron's
DDP + (distributed) Adam with FP32 master weights (GPU, Transformer Engine).

    zero_grad()                     before a mini-batch's backward
    clip_and_step(max_norm)         -> (grad norm, whether the update was applied); a non-finite norm
                                    skips the update and clears the gradients
    state_dict() / load_state_dict()
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class PolicyOptimizer(Protocol):
    """What the trainer needs from an optimizer (module docstring)."""

    averages_over_data_parallel: bool  # whether the gradient reduction over DP ranks averages (Megatron DDP)

    def zero_grad(self) -> None: ...
    def clip_and_step(self, max_norm: float) -> tuple[torch.Tensor, bool]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TorchPolicyOptimizer:
    """torch AdamW on one process's whole model (no data parallelism)."""

    averages_over_data_parallel = False

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999))

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def clip_and_step(self, max_norm: float) -> tuple[torch.Tensor, bool]:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if not torch.isfinite(grad_norm):
            self.zero_grad()
            return grad_norm, False
        self.optimizer.step()
        return grad_norm, True

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


class MegatronPolicyOptimizer:
    """Megatron DDP (grad buffers, FP32 main grads) + Megatron optimizer; clipping inside its step."""

    averages_over_data_parallel = True  # DDP's default reduction: the mean over DP ranks

    def __init__(self, ddp_model: Any, optimizer: Any) -> None:
        self.ddp_model, self.optimizer = ddp_model, optimizer

    def zero_grad(self) -> None:
        self.ddp_model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def clip_and_step(self, max_norm: float) -> tuple[torch.Tensor, bool]:
        """Reduce the gradients (DP; replicated parameters over TP; tied embeddings over PP), refuse a
        non-finite gradient anywhere (no rank steps), clip by the global norm and step."""
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        finalize_model_grads([self.ddp_model])
        if not self._all_finite():
            self.zero_grad()
            return torch.tensor(float("nan")), False
        self.optimizer.config.clip_grad = max_norm
        applied, grad_norm, _ = self.optimizer.step()
        norm = torch.tensor(float("nan") if grad_norm is None else float(grad_norm))
        if not (applied and torch.isfinite(norm)):
            self.zero_grad()
            return norm, False
        return norm, True

    def _all_finite(self) -> bool:
        """Whether every rank's reduced gradients are finite (FP32 optimizers have no inf/NaN check of their
        own: megatron checks only with a grad scaler)."""
        import torch.distributed as dist

        bad = torch.zeros(1)
        for buffer in self.ddp_model.buffers + self.ddp_model.expert_parallel_buffers:
            if not bool(torch.isfinite(buffer.grad_data).all()):
                bad[0] = 1.0
        if dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bad.item() == 0.0

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch Adam inside each of megatron's optimizers; its parameters are the FP32 main parameters
        (this rank's shard of them under the distributed optimizer)."""
        return [chained.optimizer for chained in self.optimizer.chained_optimizers]

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state: Adam's moments and the FP32 main parameters, as this rank holds them.

        megatron's own ``DistributedOptimizer.state_dict`` leaves the sharded moments out (they go through
        ``save_parameter_state`` or dist-checkpointing) and asserts before the first step, so the trainer
        saves and restores the shards itself: a checkpoint resumes on the same layout only."""
        inner = self._torch_optimizers()
        return {
            "adam": [opt.state_dict() for opt in inner],
            "main_params": [[p.detach() for group in opt.param_groups for p in group["params"]] for opt in inner],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        inner = self._torch_optimizers()
        if len(state["adam"]) != len(inner):
            raise ValueError(f"optimizer state has {len(state['adam'])} parts, this layout has {len(inner)}")
        for opt, adam, params in zip(inner, state["adam"], state["main_params"], strict=True):
            opt.load_state_dict(adam)
            mine = [p for group in opt.param_groups for p in group["params"]]
            if [p.shape for p in mine] != [p.shape for p in params]:
                raise ValueError("optimizer state was saved with another parallel layout")
            with torch.no_grad():
                for p, saved in zip(mine, params, strict=True):
                    p.copy_(saved)


def megatron_policy_optimizer(
    module: torch.nn.Module, lr: float, weight_decay: float, distributed: bool, bf16: bool
) -> tuple[torch.nn.Module, MegatronPolicyOptimizer]:
    """Megatron DDP (FP32 gradient buffers, reduced over the data-parallel group) around `module`, and Megatron's
    Adam: over FP32 parameters (the CPU emulator's), or BF16 parameters with FP32 master weights and a
    constant loss scale whose inf/NaN check skips a bad step (Transformer Engine). `distributed` shards the
    optimizer state over DP. Returns (the DDP-wrapped module, the optimizer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed
    )
    ddp_model = DistributedDataParallel(config=module.config, ddp_config=ddp_config, module=module)
    precision = {"bf16": True, "params_dtype": torch.bfloat16, "loss_scale": 1.0} if bf16 else {}
    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        weight_decay=weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.999,
        use_distributed_optimizer=distributed,
        clip_grad=0.0,  # set per step by clip_and_step
        **precision,
    )
    return ddp_model, MegatronPolicyOptimizer(ddp_model, get_megatron_optimizer(config, [ddp_model]))
