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

    def zero_grad(self) -> None: ...
    def clip_and_step(self, max_norm: float) -> tuple[torch.Tensor, bool]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TorchPolicyOptimizer:
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

    def __init__(self, ddp_model: Any, optimizer: Any) -> None:
        self.ddp_model, self.optimizer = ddp_model, optimizer

    def zero_grad(self) -> None:
        self.ddp_model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def clip_and_step(self, max_norm: float) -> tuple[torch.Tensor, bool]:
        self.ddp_model.finish_grad_sync()
        self.optimizer.config.clip_grad = max_norm
        applied, grad_norm, _ = self.optimizer.step()
        norm = torch.tensor(float("nan") if grad_norm is None else float(grad_norm))
        if not (applied and torch.isfinite(norm)):
            self.zero_grad()
            return norm, False
        return norm, True

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
