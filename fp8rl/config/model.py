"""The policy model, its parallel layout and the rollout engine that samples from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fp8rl.config.fields import DEVICES, PLACEMENTS, _one_of, _require, option


@dataclass(frozen=True)
class RolloutConfig:
    """The rollout engine and its sampling."""

    engine: str = option("builtin", "builtin (the trainer's Megatron model, KV cache) or vllm")
    temperature: float = option(1.0, "sampling temperature (> 0)")
    top_p: float = option(1.0, "nucleus mass; 1 = off")
    max_new_tokens: int | None = option(None, "response limit in tokens; None = the task's")

    def __post_init__(self) -> None:
        _require(
            self.temperature > 0,
            "rollout.temperature must be > 0 for RL sampling (log-probs of a greedy policy are degenerate)",
        )
        _require(0 < self.top_p <= 1, f"rollout.top_p={self.top_p} must be in (0, 1]")
        _require(
            self.max_new_tokens is None or self.max_new_tokens >= 1,
            f"rollout.max_new_tokens={self.max_new_tokens} must be >= 1",
        )


@dataclass(frozen=True)
class PolicyConfig:
    """The policy model: a named preset or a Hugging Face checkpoint, and its device."""

    preset: str = option("tiny", "model preset (tiny, qwen3_8b, qwen3_14b, qwen2_5_32b)")
    hf_path: str | None = option(
        None, "Hugging Face checkpoint folder (or hub id): weights, config, tokenizer", neutral=(None,)
    )
    device: str = option("cpu", "cpu or cuda")
    outlier_channels: int = option(0, "ablation: activation outlier channels injected after the warm start")
    outlier_scale: float = option(1.0, "their magnitude factor (function-preserving; fp8rl.models.outliers)")

    def __post_init__(self) -> None:
        _one_of(self.device, DEVICES, "model.device")
        _require(
            0 <= self.outlier_channels <= 128,
            f"model.outlier_channels={self.outlier_channels} must be in 0..128 (0 = off)",
        )
        _require(
            not self.outlier_channels or self.outlier_scale > 1.0,
            f"model.outlier_scale={self.outlier_scale} with model.outlier_channels={self.outlier_channels}: "
            "outliers need a factor above 1 (e.g. model.outlier_scale=32), or set model.outlier_channels=0",
        )


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout (fp8rl.models.parallel): None = the model preset's layout; set a field to override it."""

    tensor_parallel: int | None = option(None, "TP size (within a node)", neutral=(None,))
    pipeline_parallel: int | None = option(None, "PP size", neutral=(None,))
    nodes: int | None = option(None, "nodes per job (DP = nodes x GPUs / (TP x PP))", neutral=(None,))
    gpus_per_node: int | None = option(None, "GPUs (= ranks) per node", neutral=(None,))
    max_seq_len: int | None = option(None, "trainer sequence length", neutral=(None,))
    micro_batch_size: int | None = option(None, "sequences per micro-batch and rank", neutral=(None,))
    rollout_placement: str | None = option(
        None, "colocated (vLLM shares the trainer GPUs) or separate", neutral=(None,)
    )
    rollout_tensor_parallel: int | None = option(None, "vLLM's TP size", neutral=(None,))
    rollout_gpus: int | None = option(None, "separate placement: GPUs per job reserved for vLLM", neutral=(None,))
    rollout_memory_fraction: float | None = option(
        None, "colocated vLLM's share of each GPU (its gpu_memory_utilization)", neutral=(None,)
    )
    rollout_sleep: bool | None = option(
        None, "colocated vLLM sleeps (frees its share) while the trainer computes", neutral=(None,)
    )
    distributed_optimizer: bool | None = option(None, "shard the optimizer state over DP (Megatron)", neutral=(None,))
    activation_recompute: bool | None = option(None, "full activation recompute (Megatron)", neutral=(None,))
    gpu_memory_gb: float | None = option(None, "per GPU, for the memory check (H100 80, H200 141)", neutral=(None,))

    def __post_init__(self) -> None:
        if self.rollout_placement is not None:
            _one_of(self.rollout_placement, PLACEMENTS, "parallel.rollout_placement")
        sizes = ("tensor_parallel", "pipeline_parallel", "nodes", "gpus_per_node", "micro_batch_size")
        for name in sizes:
            value = getattr(self, name)
            _require(value is None or value >= 1, f"parallel.{name}={value} must be >= 1")

    def overrides(self) -> dict[str, Any]:
        """The fields set (not None): what changes the preset layout."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
