"""The built-in rollout engine: the trainer's own Megatron model, KV-cached sampling, any precision.

It shares the trainer's weights, so `sync_weights` costs nothing; its precision (BF16 or an emulated
FP8 recipe, optionally an FP8 KV cache: `fp8rl.models.kv_cache`) is set per call, independently of
the trainer's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fp8rl.models.autocast import fp8_recipe_block
from fp8rl.models.dims import ParallelDims
from fp8rl.models.gpt import compute_precision
from fp8rl.models.kv_cache import KV_SCALE_POLICIES, KvScales, fp8_kv_cache
from fp8rl.models.logprobs import left_pad
from fp8rl.models.policy import Policy
from fp8rl.models.sampling import SamplingConfig
from fp8rl.rollout.base import RolloutBatch


class BuiltinEngine:
    """Samples from the policy with the FP8 `recipe` (None = BF16) on its block linears, and an FP8 KV cache if
    asked. `policy`: a `fp8rl.models.policy.Policy` (any parallel layout), or a plain one-process model."""

    name = "builtin"

    def __init__(
        self,
        policy: Policy | torch.nn.Module,
        recipe,
        pad_id: int,
        compute: str = "bf16",
        fp8_kv_cache: bool = False,
        kv_cache_scales: str = "unit",
    ) -> None:
        self.policy = policy if isinstance(policy, Policy) else Policy(policy, None, ParallelDims.current())
        self.model = self.policy.module
        self.recipe = recipe
        self.pad_id = pad_id
        self.compute = compute
        self.fp8_kv_cache = fp8_kv_cache
        if kv_cache_scales not in KV_SCALE_POLICIES:
            raise ValueError(f"kv_cache_scales={kv_cache_scales!r}; valid: {list(KV_SCALE_POLICIES)}")
        self.calibrates_kv_cache = fp8_kv_cache and kv_cache_scales == "calibrated"
        self.kv_cache_keys = "pre_rotary"  # megatron's static inference context caches keys before rotary
        self.kv_scales: KvScales = {}  # set by the trainer after each step (calibrated scales), unit until then

    def set_kv_scales(self, scales: KvScales) -> None:
        """The FP8 KV cache's per-layer (key, value) scales for the next rollouts (`fp8rl.models.kv_cache`)."""
        self.kv_scales = dict(scales)

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seeds: Sequence[int] | None) -> RolloutBatch:
        device = _device_of(self.model)
        prompt_ids, prompt_mask = (t.to(device) for t in left_pad(prompts, self.pad_id))
        with (
            torch.no_grad(),
            compute_precision(self.compute),
            fp8_recipe_block(self.model, self.recipe),
            fp8_kv_cache(self.model, self.fp8_kv_cache, self.kv_scales if self.calibrates_kv_cache else None),
        ):
            out = self.policy.generate(prompt_ids, prompt_mask, sampling, seeds)
        return RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=out.tokens,
            response_mask=out.response_mask,
            rollout_logp=out.logprobs,
            rollout_entropy=out.entropy,
        )

    def sleep(self) -> float:
        """Nothing to free: the engine is the trained policy itself."""
        return 0.0

    def sync_weights(self, policy: Policy | torch.nn.Module) -> float:
        """Nothing to copy: the engine samples from the trainer's own weights (refuses another model)."""
        if policy is not self.policy and policy is not self.model:
            raise ValueError("the built-in engine samples from the trainer's own model; pass that policy")
        return 0.0


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
