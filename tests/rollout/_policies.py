"""Tiny policies for the rollout tests: "peaked" weights (std 0.1, so next-token distributions are far from
uniform and precision differences show in the log-probs, as in a trained model) and in-place updates."""

from __future__ import annotations

import torch

from fp8rl.models.config import ModelConfig
from fp8rl.models.gpt import build_gpt_model


def peaked_policy(cfg: ModelConfig, seed: int = 0, std: float = 0.1) -> torch.nn.Module:
    """A tiny GPTModel whose weights are N(0, std) (norm weights 1 + N(0, 0.1)), in eval mode."""
    model = build_gpt_model(cfg, seed=seed).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in name else std * noise)
    return model


def perturb_(model: torch.nn.Module, scale: float, seed: int) -> None:
    """Multiply every weight by 1 + N(0, scale), in place (a stand-in for an optimizer step)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1 + scale * torch.randn(param.shape, generator=generator))


def copy_policy(model: torch.nn.Module, cfg: ModelConfig) -> torch.nn.Module:
    """An independent copy of ``model`` (megatron models hold process groups, which deepcopy cannot copy)."""
    twin = build_gpt_model(cfg).eval()
    twin.load_state_dict(model.state_dict())
    return twin
