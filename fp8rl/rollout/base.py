"""The rollout engine interface: sample G responses per prompt with per-token rollout log-probs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from fp8rl.models.sampling import SamplingConfig

ROLLOUT_ENGINES = ("builtin", "vllm")  # fp8rl.rollout.builtin.BuiltinEngine, fp8rl.rollout.vllm_engine.VllmEngine


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

    FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "rollout_logp", "rollout_entropy")

    def to(self, device: torch.device | str) -> RolloutBatch:
        """The same rows on `device` (the trainer moves a batch once, at the step's boundary)."""
        return RolloutBatch(*(getattr(self, name).to(device) for name in self.FIELDS))

    def responses(self) -> list[list[int]]:
        """Each row's generated token ids (response pads removed)."""
        return [row[mask.bool()].tolist() for row, mask in zip(self.response_ids, self.response_mask, strict=True)]

    def select(self, rows: slice | Tensor) -> RolloutBatch:
        """A sub-batch (mini-batch) of rows."""
        return RolloutBatch(*(getattr(self, name)[rows] for name in self.FIELDS))

    @staticmethod
    def concat(
        batches: list[RolloutBatch], pad_id: int, prompt_len: int | None = None, response_len: int | None = None
    ) -> RolloutBatch:
        """The rows of several batches in one: prompts left-padded and responses right-padded to the widest
        (or to the given widths)."""
        prompt_len = prompt_len or max(b.prompt_ids.shape[1] for b in batches)
        response_len = response_len or max(b.response_ids.shape[1] for b in batches)

        def cat(name: str, width: int, value: float, left: bool) -> Tensor:
            parts = []
            for b in batches:
                t = getattr(b, name)
                missing = width - t.shape[1]
                parts.append(F.pad(t, (missing, 0) if left else (0, missing), value=value))
            return torch.cat(parts)

        return RolloutBatch(
            prompt_ids=cat("prompt_ids", prompt_len, pad_id, left=True),
            prompt_mask=cat("prompt_mask", prompt_len, 0, left=True),
            response_ids=cat("response_ids", response_len, pad_id, left=False),
            response_mask=cat("response_mask", response_len, 0, left=False),
            rollout_logp=cat("rollout_logp", response_len, 0.0, left=False),
            rollout_entropy=cat("rollout_entropy", response_len, 0.0, left=False),
        )


class RolloutEngine(Protocol):
    """What the trainer needs from a rollout engine (built-in Megatron engine, vLLM).

    An engine whose FP8 KV cache takes calibrated scales (``precision.kv_cache_scales=calibrated``) also has
    ``calibrates_kv_cache = True``, ``kv_cache_keys`` ("pre_rotary" / "post_rotary": where its cache takes the
    keys, so the trainer records their amax there), ``kv_scales`` and ``set_kv_scales(scales)`` (per layer
    (key, value) scales, used from the next rollout on); the trainer looks for them with getattr."""

    name: str

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seeds: Sequence[int] | None) -> RolloutBatch:
        """One response per prompt row; row i is sampled from its own ``seeds[i]`` (None: greedy or unseeded),
        so a row's response does not depend on which other rows share its batch."""
        ...

    def sync_weights(self, model: torch.nn.Module) -> float:
        """Make the engine sample from `model`'s current weights (waking it if it sleeps); returns the seconds."""
        ...

    def sleep(self) -> float:
        """Free what the engine holds on the accelerator while the trainer computes (a colocated vLLM's weights
        and KV cache); the next `sync_weights` or `generate` wakes it. Returns the seconds (0: nothing to free)."""
        ...
