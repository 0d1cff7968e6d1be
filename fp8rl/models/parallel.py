"""Parallel layouts for the GPU model presets on 8-GPU nodes, checked before anything launches.

A layout fixes the tensor (TP), pipeline (PP) and data (DP = world / (TP x PP)) parallel sizes of the
Megatron trainer, its sequence length and micro-batch, and where the vLLM rollout runs:

- ``colocated``: vLLM shares every trainer GPU (sleep/wake between phases), each engine over
  ``rollout_tp`` GPUs; the memory check counts vLLM's share (``rollout_memory_fraction``);
- ``separate``: ``rollout_gpus`` GPUs per job are reserved for vLLM; the trainer gets the rest.

Presets (ours; the paper gives model sizes and context lengths, not layouts). Context: the paper trains
Qwen3-8B-Base at 16K; the 4K/8K lengths it lists are assigned to the 32B and 14B runs here (*uncertain*).

| preset       | nodes x GPUs | TP | PP | DP | seq   | micro | rollout            |
|--------------|--------------|----|----|----|-------|-------|--------------------|
| qwen3_8b     | 1 x 8        | 2  | 1  | 4  | 16384 | 1     | colocated, vLLM TP 1 |
| qwen3_14b    | 1 x 8        | 4  | 1  | 2  | 8192  | 1     | colocated, vLLM TP 2 |
| qwen2_5_32b  | 2 x 8        | 8  | 1  | 2  | 4096  | 1     | colocated, vLLM TP 4 |

The memory estimate (per GPU, `memory_breakdown_gb`) is deliberately simple; per parameter P, sharded
by TP x PP unless said otherwise:

- BF16 weights: 2 bytes.
- FP32 main gradients: 4 bytes. Megatron DDP with grad_reduce_in_fp32 keeps one FP32 grad buffer of the
  whole model chunk on every data-parallel rank (megatron-core 0.16.1 distributed/param_and_grad_buffer.py:803:
  ``self.grad_data = torch.zeros(self.numel, dtype=self.grad_dtype, ...)``); the distributed optimizer
  reduce-scatters inside it, so it is not divided by DP. (The BF16 ``.grad`` of a parameter is added into
  it and freed by DDP's backward hook, distributed_data_parallel.py:438-441: not counted.)
- optimizer: FP32 master weights + Adam moments, 12 bytes, divided further by DP with the distributed
  optimizer.
- activations: with full recomputation (the default) each layer's BF16 input plus one layer's full
  activations, ~34 x seq x micro x hidden bytes / TP (Korthikanti et al. 2022); without it every layer's.
- logits of one micro-batch: seq x micro x vocab x (2/TP bytes for the TP-sharded BF16 output, 2 for its
  full-vocabulary gather when TP > 1, 4 + 4 for the FP32 copy and its log-softmax):
  fp8rl.models.logprobs gathers the vocabulary and scores in FP32 (a vocab-parallel log-softmax would
  divide all of it by TP).
- attention scores, when the trainer runs megatron's unfused local attention (the emulated and torchao FP8
  backends; TE fuses it): one layer's BF16 scores and softmax probabilities, micro x heads / TP x seq x seq x 4 bytes
  (qwen3_8b at 16K: ~17 GB at TP 2), so a paper-scale rowwise arm is refused where it cannot fit.
- colocated vLLM: its share (``rollout_memory_fraction`` x GPU memory: vLLM 0.32 treats
  gpu_memory_utilization as this engine's budget for weights, KV cache and activations). With sleep mode
  (``rollout_sleep``, the CUDA default of fp8rl.rollout.vllm_engine: level 1 offloads the weights to CPU
  and drops the KV cache) the share and the training transients (activations + logits) are never resident
  together: peak = weights + grads + optimizer + max(transients, share); without it they add up.
  `check_layout` also checks that the share holds vLLM's BF16 weights / rollout TP plus the KV cache of one
  ``max_seq_len`` sequence (2 x layers x KV heads per rank x head dim x 2 bytes per token).

It refuses layouts that cannot fit and says what to change; it does not prove a layout fits
(fragmentation, NCCL buffers, the reference model when algo.kl_coef > 0: another 2 bytes per parameter),
which only a GPU run shows.

Verified where: this module (presets, divisibility, memory check, rendered layout) is tested on CPU
(tests/models/test_parallel.py); no layout has been run on a GPU cluster from this repository yet.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fp8rl.models.config import ModelConfig, parameter_count

PLACEMENTS = ("colocated", "separate")
GPU_MEMORY_GB = {"h100": 80.0, "h200": 141.0, "b200": 180.0, "a100": 80.0}


class ParallelLayoutError(ValueError):
    """A layout that cannot run on the requested GPUs; the message says what to change."""


@dataclass(frozen=True)
class ParallelLayout:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    nodes: int = 1
    gpus_per_node: int = 8
    max_seq_len: int = 4096
    micro_batch_size: int = 1
    rollout_placement: str = "colocated"
    rollout_tensor_parallel: int = 1
    rollout_gpus: int = 0  # separate placement: GPUs per job reserved for vLLM
    rollout_memory_fraction: float = 0.35  # colocated: vLLM's share of each GPU (weights + KV cache)
    distributed_optimizer: bool = True
    activation_recompute: bool = True  # Megatron recompute_granularity="full": keep only each layer's input
    gpu_memory_gb: float = 80.0
    rollout_sleep: bool = True  # colocated vLLM sleeps (frees its share) while the trainer computes

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def trainer_gpus(self) -> int:
        return self.world_size - (self.rollout_gpus if self.rollout_placement == "separate" else 0)

    @property
    def data_parallel(self) -> int:
        return self.trainer_gpus // (self.tensor_parallel * self.pipeline_parallel)

    def describe(self, device: str = "cuda", engine: str = "vllm") -> str:
        """One line: where the trainer and the rollout run. On CPU (`device`), only the process grid: the
        optimizer, recompute and GPU-share settings are a GPU layout's."""
        if device == "cpu":
            return (
                f"{self.world_size} CPU process(es): trainer TP {self.tensor_parallel} x PP {self.pipeline_parallel} "
                f"x DP {self.data_parallel}, seq {self.max_seq_len}; rollout: the {engine} engine in those processes"
            )
        rollout = (
            f"vLLM colocated on all {self.world_size} GPUs (TP {self.rollout_tensor_parallel})"
            if self.rollout_placement == "colocated"
            else f"vLLM on {self.rollout_gpus} separate GPUs (TP {self.rollout_tensor_parallel})"
        )
        return (
            f"{self.nodes} node(s) x {self.gpus_per_node} GPUs: trainer TP {self.tensor_parallel} x PP "
            f"{self.pipeline_parallel} x DP {self.data_parallel}, seq {self.max_seq_len}, micro-batch "
            f"{self.micro_batch_size}, {'distributed' if self.distributed_optimizer else 'replicated'} optimizer"
            f"{', full recompute' if self.activation_recompute else ''}; "
            f"{rollout}"
        )


PARALLEL_PRESETS: dict[str, ParallelLayout] = {
    "tiny": ParallelLayout(gpus_per_node=1, max_seq_len=64, rollout_memory_fraction=0.2),
    "qwen3_8b": ParallelLayout(tensor_parallel=2, max_seq_len=16384, rollout_tensor_parallel=1),
    "qwen3_14b": ParallelLayout(tensor_parallel=4, max_seq_len=8192, rollout_tensor_parallel=2),
    "qwen2_5_32b": ParallelLayout(tensor_parallel=8, nodes=2, max_seq_len=4096, rollout_tensor_parallel=4),
}


def preset_layout(model_preset: str, **overrides) -> ParallelLayout:
    """The preset layout of `model_preset` (a model without a preset, e.g. a Hugging Face checkpoint, starts
    from `ParallelLayout`'s defaults), with `overrides` (None values ignored) applied."""
    changes = {k: v for k, v in overrides.items() if v is not None}
    unknown = set(changes) - {f.name for f in dataclasses.fields(ParallelLayout)}
    if unknown:
        raise ParallelLayoutError(f"unknown parallel settings {sorted(unknown)}")
    return dataclasses.replace(PARALLEL_PRESETS.get(model_preset, ParallelLayout()), **changes)


def check_layout(
    layout: ParallelLayout, model: ModelConfig, memory: bool = True, unfused_attention: bool = False
) -> None:
    """Raise ParallelLayoutError naming the setting to change when `layout` cannot run `model` (and, with
    `memory`, when the per-GPU memory estimate exceeds the GPU; `unfused_attention`: the trainer runs megatron's
    local attention, as the emulated FP8 backend does, which materialises every head's scores)."""
    tp, pp = layout.tensor_parallel, layout.pipeline_parallel
    if layout.rollout_placement not in PLACEMENTS:
        raise ParallelLayoutError(
            f"parallel.rollout_placement={layout.rollout_placement!r}; choose one of {PLACEMENTS}"
        )
    if min(tp, pp, layout.nodes, layout.gpus_per_node, layout.micro_batch_size, layout.rollout_tensor_parallel) < 1:
        raise ParallelLayoutError("parallel sizes, nodes, GPUs per node and micro-batch size must all be >= 1")
    if tp > layout.gpus_per_node:
        raise ParallelLayoutError(
            f"parallel.tensor_parallel={tp} spans more than one node ({layout.gpus_per_node} GPUs): keep TP within "
            "NVLink, use parallel.pipeline_parallel for more"
        )
    if model.num_attention_heads % tp or model.num_query_groups % tp and tp % model.num_query_groups:
        raise ParallelLayoutError(
            f"parallel.tensor_parallel={tp} does not divide {model.name}'s {model.num_attention_heads} query heads / "
            f"{model.num_query_groups} KV groups; choose a TP in {valid_tensor_parallel(model, layout.gpus_per_node)}"
        )
    if model.num_layers % pp:
        raise ParallelLayoutError(
            f"parallel.pipeline_parallel={pp} does not divide {model.name}'s {model.num_layers} layers; choose one of "
            f"{_divisors(model.num_layers, layout.world_size)}"
        )
    if layout.max_seq_len > model.max_seq_len:
        raise ParallelLayoutError(
            f"parallel.max_seq_len={layout.max_seq_len} exceeds {model.name}'s {model.max_seq_len} positions"
        )
    if layout.rollout_placement == "separate":
        if not 0 < layout.rollout_gpus < layout.world_size:
            raise ParallelLayoutError(
                f"parallel.rollout_placement=separate needs 0 < parallel.rollout_gpus < {layout.world_size} GPUs"
            )
        if layout.rollout_gpus % layout.rollout_tensor_parallel:
            raise ParallelLayoutError(
                f"parallel.rollout_gpus={layout.rollout_gpus} is not a multiple of the vLLM TP "
                f"{layout.rollout_tensor_parallel}"
            )
    elif layout.rollout_gpus:
        raise ParallelLayoutError("parallel.rollout_gpus is for rollout_placement=separate; set it to 0 or switch")
    elif layout.world_size % layout.rollout_tensor_parallel:
        raise ParallelLayoutError(
            f"parallel.rollout_tensor_parallel={layout.rollout_tensor_parallel} does not divide the "
            f"{layout.world_size} GPUs the colocated vLLM engines share: choose a divisor"
        )
    if not 0 < layout.rollout_memory_fraction < 1:
        raise ParallelLayoutError(
            f"parallel.rollout_memory_fraction={layout.rollout_memory_fraction} must be in (0, 1): it is vLLM's share "
            "of each GPU"
        )
    if layout.trainer_gpus % (tp * pp) or layout.data_parallel < 1:
        raise ParallelLayoutError(
            f"{layout.trainer_gpus} trainer GPUs are not a multiple of TP x PP = {tp * pp}; change "
            "parallel.tensor_parallel / pipeline_parallel or the node count"
        )
    if not memory:
        return
    parts = memory_breakdown_gb(layout, model, unfused_attention)
    need, have = parts["total"], layout.gpu_memory_gb
    if need > have and parts["attention_scores"] > 0:
        raise ParallelLayoutError(
            f"{model.name} with {layout.describe()} needs ~{need:.0f} GB per GPU (estimate), the GPU has "
            f"{have:.0f} GB; "
            f"~{parts['attention_scores']:.0f} GB of it are one layer's attention scores and probabilities, which the "
            "emulated and torchao FP8 backends materialise (megatron's unfused local attention): lower "
            "parallel.max_seq_len, or "
            "train with precision.backend=te (recipes tensorwise, blockwise, mxfp8; rowwise has no fused FP8 path)"
        )
    if need > have:
        raise ParallelLayoutError(
            f"{model.name} with {layout.describe()} needs ~{need:.0f} GB per GPU (estimate), "
            f"the GPU has {have:.0f} GB: "
            "raise parallel.tensor_parallel or pipeline_parallel, add nodes (more DP shards the optimizer), lower "
            "parallel.max_seq_len / micro_batch_size, or use rollout_placement=separate"
        )
    rollout_need = parts["rollout_weights"] + parts["rollout_kv_one_sequence"]
    rollout_have = parts["rollout"] if layout.rollout_placement == "colocated" else have
    if rollout_need > rollout_have:
        raise ParallelLayoutError(
            f"vLLM needs ~{rollout_need:.0f} GB per GPU for {model.name} (BF16 weights / rollout TP "
            f"{layout.rollout_tensor_parallel} + the KV cache of one {layout.max_seq_len}-token sequence), its share "
            f"is {rollout_have:.0f} GB: raise parallel.rollout_tensor_parallel or rollout_memory_fraction"
        )


def memory_breakdown_gb(
    layout: ParallelLayout, model: ModelConfig, unfused_attention: bool = False
) -> dict[str, float]:
    """Per-GPU memory estimate in GB, by part (module docstring); "total" is the peak `check_layout` compares.

    Keys: weights, main_grads, optimizer (resident), activations, logits, attention_scores (training transients;
    the last only with `unfused_attention`: one layer's BF16 scores and softmax probabilities, micro x heads / TP x
    seq x seq x 4 bytes, ~17 GB per 16K sequence for qwen3_8b's 32 heads), rollout
    (the colocated vLLM share, 0 when separate), rollout_weights and rollout_kv_one_sequence (what the vLLM
    engine needs at least), total.
    """
    params = parameter_count(model)
    tp, pp = layout.tensor_parallel, layout.pipeline_parallel
    shard = tp * pp
    optimizer_shard = shard * (layout.data_parallel if layout.distributed_optimizer else 1)
    layers_here = model.num_layers / pp
    tokens = layout.max_seq_len * layout.micro_batch_size
    per_layer = 34.0 * tokens * model.hidden_size / tp
    if layout.activation_recompute:  # stored: each layer's BF16 input; live: one layer's full activations
        activations = 2.0 * tokens * model.hidden_size * layers_here / tp + per_layer
    else:
        activations = per_layer * layers_here
    logits = tokens * model.vocab_size * (2.0 / tp + (2.0 if tp > 1 else 0.0) + 8.0)
    rollout_tp = layout.rollout_tensor_parallel
    kv_heads = max(1, model.num_query_groups // rollout_tp)
    colocated = layout.rollout_placement == "colocated"
    parts = {
        "weights": 2.0 * params / shard,
        "main_grads": 4.0 * params / shard,
        "optimizer": 12.0 * params / optimizer_shard,
        "activations": activations,
        "logits": logits,
        "attention_scores": (
            4.0 * layout.micro_batch_size * -(-model.num_attention_heads // tp) * layout.max_seq_len**2
            if unfused_attention
            else 0.0
        ),
        "rollout": layout.rollout_memory_fraction * layout.gpu_memory_gb * 1e9 if colocated else 0.0,
        "rollout_weights": 2.0 * params / rollout_tp,
        "rollout_kv_one_sequence": 2.0 * model.num_layers * kv_heads * model.kv_channels * 2.0 * layout.max_seq_len,
    }
    parts = {k: v / 1e9 for k, v in parts.items()}
    resident = parts["weights"] + parts["main_grads"] + parts["optimizer"]
    transients = parts["activations"] + parts["logits"] + parts["attention_scores"]
    if layout.rollout_sleep:
        parts["total"] = resident + max(transients, parts["rollout"])
    else:
        parts["total"] = resident + transients + parts["rollout"]
    return parts


def estimate_memory_gb(layout: ParallelLayout, model: ModelConfig, unfused_attention: bool = False) -> float:
    """Per-GPU peak memory estimate of the trainer and the colocated vLLM, in GB (`memory_breakdown_gb`)."""
    return memory_breakdown_gb(layout, model, unfused_attention)["total"]


def valid_tensor_parallel(model: ModelConfig, limit: int) -> list[int]:
    """TP sizes up to `limit` that split the query heads and the KV groups (or replicate the groups)."""
    groups = model.num_query_groups
    return [d for d in _divisors(model.num_attention_heads, limit) if groups % d == 0 or d % groups == 0]


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, limit + 1) if n % d == 0]
