"""The FP8 recipe of a block of code, whichever backend built the model: the emulated FP8-switchable linears
(`fp8rl.models.gpt.fp8_autocast`) or Transformer Engine's layers (`fp8rl.models.te_backend.te_fp8`)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from fp8rl.models.gpt import fp8_autocast
from fp8rl.models.logprobs import is_te_model


def fp8_recipe_block(model: torch.nn.Module, recipe: Any) -> AbstractContextManager:
    """Run the block with `recipe` (None = BF16) on `model`'s GEMMs."""
    if is_te_model(model):
        from fp8rl.models.te_backend import te_fp8

        return te_fp8(model, recipe)
    return fp8_autocast(model, recipe)
