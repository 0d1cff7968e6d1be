"""Which FP8 recipe each part of the pipeline runs in, for a precision mode.

| mode        | rollout | old / current log-probs (trainer) | BF16 shadow |
|-------------|---------|-----------------------------------|-------------|
| bf16        | BF16    | BF16                              | -           |
| fp8_rollout | FP8     | BF16                              | -           |
| fp8_full    | FP8     | FP8 (forward and backward)        | BF16        |

Everything that is not an FP8 GEMM runs under BF16 autocast with FP32 master weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fp8rl.config import PrecisionConfig
from fp8rl.models.autocast import fp8_recipe_block
from fp8rl.models.gpt import compute_precision
from fp8rl.quant import Fp8Recipe
from fp8rl.quant.recipes import recipe_of


@dataclass(frozen=True)
class PrecisionPlan:
    rollout_recipe: Fp8Recipe | None
    train_recipe: Fp8Recipe | None
    compute: str = "bf16"


def plan_precision(cfg: PrecisionConfig) -> PrecisionPlan:
    if cfg.mode == "bf16":
        return PrecisionPlan(None, None, cfg.compute)
    recipe = recipe_of(cfg)
    if cfg.mode == "fp8_rollout":
        return PrecisionPlan(recipe, None, cfg.compute)
    return PrecisionPlan(recipe, recipe, cfg.compute)


@contextlib.contextmanager
def running_in(model: torch.nn.Module, recipe: Fp8Recipe | None, compute: str = "bf16") -> Iterator[None]:
    """BF16 autocast plus `recipe` (None = BF16) on the model's block linears."""
    with compute_precision(compute), fp8_recipe_block(model, recipe):
        yield
