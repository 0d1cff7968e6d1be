"""The policy on this rank, whatever the parallel layout: build it, score responses, run a loss's forward and
backward, sample from it.

megatron's process state (`fp8rl.models.runtime.init_megatron`) fixes the layout: TP x PP x DP ranks
(`fp8rl.models.dims.ParallelDims`). This rank holds a tensor-parallel shard of a pipeline stage of the model;
`Policy` hides which:

- `build_policy`: this rank's model with the full (TP = PP = 1) start weights, split as megatron splits them
  (column-parallel linears by output rows, the fused QKV by whole query groups, the SwiGLU fc1 by [gate; up]
  halves, row-parallel linears by input columns, the vocabulary by rows; pipeline stages by layer).
- `Policy.logprobs`: per-token log-probs and entropies of the response tokens, on EVERY rank. Under TP they
  come from vocabulary-parallel logits (`fp8rl.models.vocab_parallel`: two all-reduces, no gather); under PP
  from the last stage through megatron's pipeline schedule, broadcast over the pipeline group.
- `Policy.forward_backward`: one mini-batch's loss (a function of the log-probs and entropies the caller
  gives) and its backward, over micro-batches through the pipeline schedule when PP > 1.
- `Policy.generate`: KV-cached sampling (`fp8rl.models.generate`); under TP every rank of a TP group samples
  the same rows from gathered logits; under PP the decode steps run stage by stage (`fp8rl.models.pipeline`).

The caller enters the precision context (`fp8rl.trainer.precision.running_in`) around these calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import Tensor

from fp8rl.models.config import ModelConfig
from fp8rl.models.dims import ParallelDims
from fp8rl.models.generate import GenerationOutput, generate
from fp8rl.models.gpt import build_gpt_model
from fp8rl.models.logprobs import (
    SequenceBatch,
    Sequences,
    logprobs_and_entropy_from_logits,
    model_attention_mask,
    position_ids_from_mask,
)
from fp8rl.models.sampling import SamplingConfig
from fp8rl.models.vocab_parallel import vocab_parallel_logprobs_and_entropy

# (logp, entropy) of one micro-batch's response tokens, both (b, response_len) -> (loss, metrics)
LossFn = Callable[[Tensor, Tensor], tuple[Tensor, dict[str, float]]]


def shard_for_tensor_parallel(full: Tensor, param: Tensor, tp_rank: int, tp_size: int) -> Tensor:
    """This rank's shard of a full (TP = 1) tensor for a megatron parameter, as megatron's CPU initialisation
    splits it: `tp_size` x stride chunks along the parameter's ``partition_dim``, taking chunks rank, rank + tp,
    ... (the SwiGLU fc1 has stride 2: [gate_r; up_r]). Replicated parameters (norms) come whole."""
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    chunk = full.shape[dim] // (tp_size * stride)
    return torch.cat(torch.split(full, chunk, dim=dim)[tp_rank::tp_size], dim=dim)


def build_policy(
    cfg: ModelConfig, full_state: Mapping[str, Tensor] | None, seed: int, device: torch.device, dims: ParallelDims
) -> Policy:
    """This rank's policy with the full start weights (None: the seed's initialisation of the whole model)."""
    if dims.pp > 1:
        from fp8rl.models.pipeline import build_gpt_stage

        module = build_gpt_stage(cfg, seed, full_state_dict=full_state)
    else:
        module = build_gpt_model(cfg, seed=seed)
        if full_state is not None:
            load_full_state(module, full_state, dims)
    return Policy(module.to(device), cfg, dims)


def load_full_state(module: torch.nn.Module, full_state: Mapping[str, Tensor], dims: ParallelDims) -> None:
    """Load a full (TP = 1) state dict into this rank's TP shard; only megatron's ``_extra_state`` may be
    missing and nothing may be left over. Read entry by entry: from a lazy mapping (a HF checkpoint) a rank holds
    its shards and one full tensor at a time."""
    params = dict(module.named_parameters())
    shards = {
        key: shard_for_tensor_parallel(value, params[key], dims.tp_rank, dims.tp) if key in params else value
        for key, value in full_state.items()
    }
    missing, unexpected = module.load_state_dict(shards, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"start weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


class Policy:
    """This rank's part of the policy model (module docstring)."""

    def __init__(self, module: torch.nn.Module, cfg: ModelConfig, dims: ParallelDims) -> None:
        self.module, self.cfg, self.dims = module, cfg, dims

    # ------------------------------------------------------------------------------------------ scoring
    def response_logprobs(
        self, logits: Tensor, input_ids: Tensor, response_len: int, temperature: float, vocab_size: int | None
    ) -> tuple[Tensor, Tensor]:
        """(logp, entropy) of the last `response_len` tokens from the full-sequence logits (b, s, V / TP)."""
        shifted, tokens = logits[:, -response_len - 1 : -1, :], input_ids[:, -response_len:]
        if self.dims.tp == 1:
            return logprobs_and_entropy_from_logits(shifted[..., :vocab_size], tokens, temperature)
        width = shifted.shape[-1]
        start = self.dims.tp_rank * width
        group = parallel_state.get_tensor_model_parallel_group()
        end = start + width
        return vocab_parallel_logprobs_and_entropy(shifted, tokens, temperature, start, end, group, vocab_size)

    def logprobs(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        response_len: int,
        temperature: float,
        vocab_size: int | None,
        grad: bool = False,
        micro_batch_size: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Per-token (log-prob, entropy) of the last `response_len` tokens of each row, (b, response_len) fp32, on
        every rank. `grad` keeps the graph (PP: forward-only, always detached). `micro_batch_size`: forward that
        many rows at a time (a GPU rank's batch holds far more logits than fit at once); None: all at once."""
        if not 0 < response_len < input_ids.size(1):
            raise ValueError(f"response_len={response_len} must be in (0, {input_ids.size(1)})")
        size = micro_batch_size or input_ids.size(0)
        chunks = [
            SequenceBatch(input_ids[start : start + size], attention_mask[start : start + size], response_len)
            for start in range(0, input_ids.size(0), size)
        ]
        if self.dims.pp > 1:
            from fp8rl.models.pipeline import pipeline_logprobs

            scored = pipeline_logprobs(
                self.module, chunks, temperature=temperature, vocab_size=vocab_size, logprobs_fn=self.response_logprobs
            )
        else:
            scored = [self._logprobs(c, temperature, vocab_size, grad) for c in chunks]
        if len(scored) == 1:
            return scored[0]
        return torch.cat([logp for logp, _ in scored]), torch.cat([entropy for _, entropy in scored])

    def _logprobs(self, batch: SequenceBatch, temperature: float, vocab_size: int | None, grad: bool):
        input_ids, attention_mask, response_len = batch.input_ids, batch.attention_mask, batch.response_len
        context = contextlib.nullcontext() if grad else torch.no_grad()
        with context:
            mask = model_attention_mask(self.module, attention_mask)
            logits = self.module(input_ids, position_ids_from_mask(attention_mask), mask)
            return self.response_logprobs(logits, input_ids, response_len, temperature, vocab_size)

    # ------------------------------------------------------------------------------------------ training
    def forward_backward(
        self,
        micro_batches: Sequence[Sequences],
        loss_fn: Callable[[Sequences, Tensor, Tensor], tuple[Tensor, dict[str, float]]],
        temperature: float,
        vocab_size: int | None,
    ) -> tuple[list[dict[str, float]], list[Tensor]]:
        """Forward and backward of ``sum over micro-batches of loss_fn(mb, logp, entropy)`` (each micro-batch's
        loss already normalised by the caller for the whole mini-batch); gradients accumulate. Returns, on every
        rank, each micro-batch's metrics and its detached log-probs (b, response_len).

        Micro-batches: :class:`~fp8rl.models.logprobs.Sequences` carrying what `loss_fn` reads."""
        if self.dims.pp > 1:
            from fp8rl.models.pipeline import pipeline_forward_backward

            return pipeline_forward_backward(
                self.module, list(micro_batches), loss_fn, temperature, vocab_size, self.response_logprobs
            )
        metrics, logps = [], []
        for mb in micro_batches:
            logp, entropy = self.logprobs(
                mb.input_ids, mb.attention_mask, mb.response_len, temperature, vocab_size, grad=True
            )
            loss, mb_metrics = loss_fn(mb, logp, entropy)
            mb_metrics["loss_finite"] = float(torch.isfinite(loss))
            if mb_metrics["loss_finite"]:
                loss.backward()
            metrics.append(mb_metrics)
            logps.append(logp.detach())
        return metrics, logps

    # ------------------------------------------------------------------------------------------ sampling
    def generate(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        sampling: SamplingConfig,
        seeds: Sequence[int] | None,
    ) -> GenerationOutput:
        """Sample after each left-padded prompt; the same result on every rank of the model-parallel group."""
        if self.dims.pp > 1:
            from fp8rl.models.pipeline import pipeline_generate

            return pipeline_generate(self.module, prompt_ids, prompt_mask, sampling, seeds)
        return generate(self.module, prompt_ids, prompt_mask, sampling, seeds)

    # ------------------------------------------------------------------------------------------ state
    def full_state_dict(self) -> dict[str, Tensor]:
        """The whole model's tensors under the TP = PP = 1 names, gathered on every rank (weight pushes to a
        rollout engine, Hugging Face export)."""
        model = unwrapped(self.module)
        state = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
        if self.dims.tp == 1 and self.dims.pp == 1:
            return state
        params = dict(model.named_parameters())
        gathered = {}
        for key, value in state.items():
            param = params.get(key)
            gathered[key] = _gather_tensor_parallel(value, param, self.dims) if param is not None else value
        if self.dims.pp > 1:
            from fp8rl.models.pipeline import gather_stages

            gathered = gather_stages(self.module, gathered)
        return gathered


def unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside megatron's wrappers (DistributedDataParallel, Float16Module)."""
    while hasattr(module, "module"):
        module = module.module
    return module


def _gather_tensor_parallel(shard: Tensor, param: Tensor, dims: ParallelDims) -> Tensor:
    """Inverse of `shard_for_tensor_parallel` over the TP group."""
    if dims.tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return shard
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    pieces = [torch.empty_like(shard) for _ in range(dims.tp)]
    dist.all_gather(pieces, shard.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    chunks = [piece.chunk(stride, dim=dim) for piece in pieces]  # rank r holds chunks r, r + tp, ...
    return torch.cat([chunks[rank][s] for s in range(stride) for rank in range(dims.tp)], dim=dim)
