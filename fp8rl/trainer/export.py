"""Hugging Face checkpoints of the policy during training (``trainer.export_every``): a folder that vLLM,
``transformers`` or an evaluation harness loads, written under the run folder as ``hf/step_NNNNNN``.

Every rank takes part (the policy's TP shards and PP stages are gathered); rank 0 writes the folder, in BF16,
with the tokenizer's files (the character tokenizer of the tiny task, or the checkpoint's own).
"""

from __future__ import annotations

from pathlib import Path

import torch

from fp8rl.models.hf import local_names, save_hf_checkpoint
from fp8rl.models.policy import Policy, unwrapped


def export_hf_checkpoint(policy: Policy, tokenizer: object, folder: str | Path, rank: int) -> Path:
    """Write `policy`'s full weights to `folder` as a Hugging Face checkpoint (collective; rank 0 writes)."""
    state = local_names(unwrapped(policy.module), policy.full_state_dict())
    if rank == 0:
        source = (
            tokenizer if hasattr(tokenizer, "save") else getattr(getattr(tokenizer, "hf", None), "name_or_path", None)
        )
        save_hf_checkpoint(state, policy.cfg, folder, tokenizer=source, dtype=torch.bfloat16)
    return Path(folder)
