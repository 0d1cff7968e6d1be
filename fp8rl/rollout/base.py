"""The rollout engine interface: sample G responses per prompt with per-token rollout log-probs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from fp8rl.models.generate import SamplingConfig


@dataclass
class RolloutBatch:
    """Prompts (left-padded) and sampled responses (right-padded), one row per sample."""

    prompt_ids: Tensor  # (batch, prompt_len) long
    prompt_mask: Tensor  # (batch, prompt_len) long, 1 = token
    response_ids: Tensor  # (batch, response_len) long
    response_mask: Tensor  # (batch, response_len) long, 1 = generated token (EOS included)
    rollout_logp: Tensor  # (batch, response_len) fp32, log-prob under the rollout engine's precision
    rollout_entropy: Tensor  # (batch, response_len) fp32

    @property
    def input_ids(self) -> Tensor:
        """(batch, prompt_len + response_len): the trainer's layout (see fp8rl.models.logprobs)."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    def select(self, rows: slice | Tensor) -> RolloutBatch:
        """A sub-batch (mini-batch) of rows."""
        return RolloutBatch(*(getattr(self, name)[rows] for name in self.__dataclass_fields__))


class RolloutEngine(Protocol):
    """What the trainer needs from a rollout engine (built-in Megatron engine, vLLM)."""

    name: str

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, generator: torch.Generator | None
    ) -> RolloutBatch: ...

    def sync_weights(self, model: torch.nn.Module) -> float:
        """Make the engine sample from `model`'s current weights; returns the seconds it took."""
        ...
