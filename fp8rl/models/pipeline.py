"""The policy split over pipeline stages, run through megatron-core's pipeline schedule for RL.

Prototype-grade (verified on CPU/gloo with PP=2 only; not yet wired into the trainer). Everything here needs
``parallel_state.initialize_model_parallel(..., pipeline_model_parallel_size=P)`` first.

- :func:`build_gpt_stage`: this rank's GPTModel (embedding on the first stage, final norm + output layer on the
  last) with the PP=1 model's weights (from a PP=1 state dict, or built from the seed for tiny CPU models).
  Building a stage from the seed alone does NOT reproduce the PP=1 weights: the CPU init draws from one RNG
  stream in module order, so later stages would get the embedding's draws.
- :func:`pipeline_logprobs`: forward-only; per-token log-probs and entropies of the response tokens of every
  micro-batch, computed on the last stage and broadcast to every pipeline rank.
- :func:`pipeline_loss_backward`: forward + backward of a per-token loss normalised over ALL micro-batches
  (sum of token losses / total tokens), the 1F1B schedule's way: the loss function returns a 2-tuple, which
  ``schedules.forward_step_calc_loss`` divides by ``num_microbatches``, so each micro-batch returns
  ``sum * num_microbatches / total_tokens``.

Micro-batches are :class:`fp8rl.models.logprobs.Sequences`: ``input_ids`` and ``attention_mask`` (b, s),
``response_len`` (int), plus whatever the caller's token loss reads. Every rank iterates the same list (the schedule
calls the forward step on every stage). Shapes may differ between micro-batches (``variable_seq_lengths``).

``config.pipeline_dtype`` is set per call from the precision context: the activations sent between stages are
in the autocast dtype when autocast is on (megatron casts the residual to the block output's dtype,
fusions/fused_bias_dropout.py:34), else in the parameter dtype. A mismatch is not an error on gloo: the receiver
reads a bf16 message into an fp32 buffer and computes on garbage (measured: log-prob error 0.4-0.6).

CPU-only torch: megatron's schedule and p2p code call ``torch.cuda.current_device()``, ``torch.cuda.synchronize()``
and create a tensor with ``device="cuda"``; :func:`cpu_schedule_shims` maps those to the CPU for the duration
of a call (nothing is patched on a CUDA host).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from torch.overrides import TorchFunctionMode

from fp8rl.models.config import ModelConfig
from fp8rl.models.gpt import build_gpt_model, fp8_switchable_layer_spec, transformer_config
from fp8rl.models.logprobs import (
    Sequences,
    logprobs_and_entropy_from_logits,
    model_attention_mask,
    position_ids_from_mask,
)

_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.")

Precision = Callable[[], contextlib.AbstractContextManager]
TokenLoss = Callable[[Sequences, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


# ------------------------------------------------------------------------------------------------------------
# CPU shims for the schedule


def _is_cuda(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """``device="cuda"`` (or an int) -> CPU in torch calls; ``Tensor.cuda()`` -> the tensor itself."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": torch.device("cpu")}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_schedule_shims() -> Iterator[None]:
    """On a CPU-only torch, for the block: torch.cuda.current_device() -> cpu (p2p_communication.py:190-202,
    313, 321), torch.cuda.synchronize() -> no-op (p2p_communication.py:242, 398), device="cuda" -> cpu
    (schedules.py:2138) and Tensor.cuda() -> itself (language_module.py:244, tied embeddings). The mode is a
    per-op Python hook (measured +30-55% on a 3x13-token forward of a 4-layer 64-wide model). No-op with CUDA."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    try:
        with _CudaToCpu():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved


# ------------------------------------------------------------------------------------------------------------
# Stages


def stage_transformer_config(cfg: ModelConfig, pipeline_dtype: torch.dtype = torch.float32, variable_seq_lengths=True):
    """The PP=1 TransformerConfig plus the pipeline fields.

    ``pipeline_model_parallel_size`` is what makes TransformerBlock build only this rank's layers
    (get_num_layers_to_build / get_transformer_layer_offset read it; the rank comes from parallel_state).
    ``variable_seq_lengths`` exchanges each micro-batch's activation shape before sending it; the config then
    needs a MoE dispatcher other than the default "allgather" (transformer_config.py:1827-1831 rejects the
    combination even for a dense model; the dispatcher is unused here).
    """
    extra = {"moe_token_dispatcher_type": "alltoall"} if variable_seq_lengths else {}
    return dataclasses.replace(
        transformer_config(cfg),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=pipeline_dtype,
        variable_seq_lengths=variable_seq_lengths,
        **extra,
    )


def stage_layer_range(config) -> tuple[int, int]:
    """(global index of this rank's first layer, number of layers on this rank)."""
    return get_transformer_layer_offset(config), get_num_layers_to_build(config)


def global_key(local_key: str, offset: int) -> str:
    """A stage's state-dict key -> the PP=1 key: ``decoder.layers.<i>.`` -> ``decoder.layers.<i + offset>.``."""
    return _LAYER_KEY.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", local_key)


def stage_state_dict(full: dict[str, Any], stage: GPTModel) -> dict[str, Any]:
    """The entries of a PP=1 state dict that ``stage`` holds, under the stage's own keys.

    Tied embeddings: the last stage's output weight is the PP=1 model's word embedding.
    """
    offset, _ = stage_layer_range(stage.config)
    out = {}
    for key in stage.state_dict():
        source = global_key(key, offset)
        if key == "output_layer.weight" and source not in full and stage.share_embeddings_and_output_weights:
            source = "embedding.word_embeddings.weight"
        if source not in full and key.endswith("_extra_state"):
            continue  # FP8 metadata a plain-torch checkpoint does not carry
        out[key] = full[source]
    return out


def build_gpt_stage(
    cfg: ModelConfig,
    seed: int = 0,
    *,
    full_state_dict: dict[str, Any] | None = None,
    pipeline_dtype: torch.dtype = torch.float32,
    variable_seq_lengths: bool = True,
) -> GPTModel:
    """This pipeline rank's GPTModel with the PP=1 model's weights.

    The weights come from ``full_state_dict`` (a PP=1 state dict: warm start, HF import), or, if None, from
    ``build_gpt_model(cfg, seed)`` built here in full (tiny CPU models only).
    """
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if full_state_dict is None:
        full_state_dict = build_gpt_model(cfg, seed).state_dict()
    config = stage_transformer_config(cfg, pipeline_dtype, variable_seq_lengths)
    with torch.random.fork_rng(devices=[]), cpu_schedule_shims():
        torch.manual_seed(seed)
        stage = GPTModel(
            config=config,
            transformer_layer_spec=fp8_switchable_layer_spec(cfg),
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.max_seq_len,
            pre_process=pp_rank == 0,
            post_process=pp_rank == pp_size - 1,
            share_embeddings_and_output_weights=cfg.tie_embeddings,
            position_embedding_type="rope",
            rotary_base=cfg.rotary_base,
        )
    missing, unexpected = stage.load_state_dict(stage_state_dict(full_state_dict, stage), strict=False)
    missing = [key for key in missing if not key.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"stage weights do not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return stage


def sync_tied_embedding_grads(model: torch.nn.Module) -> None:
    """Tied embeddings without Megatron DDP: sum the first stage's embedding grad and the last stage's output
    weight grad over the embedding group (megatron's finalize_model_grads does this for a DDP-wrapped model).
    Without it the two copies get different updates and drift apart."""
    module = getattr(model, "module", model)
    if not module.share_embeddings_and_output_weights or parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    if not (module.pre_process or module.post_process):
        return
    grad = module.shared_embedding_or_output_weight().grad
    if grad is not None:
        dist.all_reduce(grad, group=parallel_state.get_embedding_group())


# ------------------------------------------------------------------------------------------------------------
# Schedule


def activation_dtype(model: torch.nn.Module, precision: Precision) -> torch.dtype:
    """The dtype of the hidden states a stage sends under ``precision``: autocast's dtype when it enables
    autocast, else the parameters' dtype."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    with precision():
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    return getattr(model, "module", model).config.params_dtype


def response_logprobs(mb: Sequences, logits: torch.Tensor, temperature: float, vocab_size: int | None):
    """Last stage: (logp, entropy), each (b, response_len) fp32, from the full-sequence logits (b, s, V)."""
    r = mb.response_len
    return logprobs_and_entropy_from_logits(logits[:, -r - 1 : -1, :vocab_size], mb.input_ids[:, -r:], temperature)


# (logits, input_ids, response_len, temperature, vocab_size) -> (logp, entropy): e.g. vocabulary-parallel under TP
LogprobsFn = Callable[[torch.Tensor, torch.Tensor, int, float, "int | None"], tuple[torch.Tensor, torch.Tensor]]


def _score(logprobs_fn: LogprobsFn | None, mb: Sequences, logits: torch.Tensor, temperature: float, vocab_size):
    if logprobs_fn is None:
        return response_logprobs(mb, logits, temperature, vocab_size)
    return logprobs_fn(logits, mb.input_ids, mb.response_len, temperature, vocab_size)


def _forward_step(precision: Precision, data_iterator, model):
    mb = next(data_iterator)
    ids, am = mb.input_ids, mb.attention_mask
    with precision():
        output = model(ids, position_ids_from_mask(am), model_attention_mask(model, am))
    return output, mb


def _run_schedule(
    model,
    microbatches: list[Sequences],
    forward_step_func,
    precision: Precision,
    *,
    forward_only: bool,
    collect_non_loss_data: bool,
) -> list:
    config = getattr(model, "module", model).config
    saved_dtype = config.pipeline_dtype
    config.pipeline_dtype = activation_dtype(model, precision)
    try:
        with cpu_schedule_shims():
            return get_forward_backward_func()(
                forward_step_func=forward_step_func,
                data_iterator=iter(microbatches),
                model=[model],
                num_microbatches=len(microbatches),
                # seq_length / micro_batch_size fix the activation shape when variable_seq_lengths is False
                seq_length=max(mb.input_ids.shape[1] for mb in microbatches),
                micro_batch_size=max(mb.input_ids.shape[0] for mb in microbatches),
                forward_only=forward_only,
                collect_non_loss_data=collect_non_loss_data,
            )
    finally:
        config.pipeline_dtype = saved_dtype


def broadcast_from_last_stage(
    tensors: list[torch.Tensor] | None, shapes: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """One broadcast over the pipeline group of fp32 tensors given on the last stage (None elsewhere)."""
    numels = [int(torch.Size(shape).numel()) for shape in shapes]
    if parallel_state.is_pipeline_last_stage():
        flat = torch.cat([t.detach().float().reshape(-1) for t in tensors])
    else:
        flat = torch.empty(sum(numels), dtype=torch.float32)
    dist.broadcast(
        flat,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return [part.view(*shape) for part, shape in zip(flat.split(numels), shapes, strict=True)]


def pipeline_logprobs(
    model: torch.nn.Module,
    microbatches: list[Sequences],
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    precision: Precision = contextlib.nullcontext,
    logprobs_fn: LogprobsFn | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Forward-only: [(logp, entropy)] per micro-batch, each (b, response_len) fp32, on EVERY pipeline rank.

    The loss of PPO is computed on the last stage only, which is where these are needed; the broadcast
    (one collective of b x response_len x 2 floats per micro-batch) lets every rank log the same metrics.
    """

    def collect(mb, output, non_loss_data=False):
        logp, entropy = _score(logprobs_fn, mb, output, temperature, vocab_size)
        return {"logp": logp.detach(), "entropy": entropy.detach()}

    def forward_step(data_iterator, model):
        output, mb = _forward_step(precision, data_iterator, model)
        return output, partial(collect, mb)

    with torch.no_grad():
        store = _run_schedule(
            model, microbatches, forward_step, precision, forward_only=True, collect_non_loss_data=True
        )
    shapes = [(mb.input_ids.shape[0], mb.response_len) for mb in microbatches for _ in range(2)]
    mine = (
        [t for item in store for t in (item["logp"], item["entropy"])]
        if parallel_state.is_pipeline_last_stage()
        else None
    )
    out = broadcast_from_last_stage(mine, shapes)
    return [(out[2 * i], out[2 * i + 1]) for i in range(len(microbatches))]


def pipeline_loss_backward(
    model: torch.nn.Module,
    microbatches: list[Sequences],
    token_loss: TokenLoss,
    *,
    total_tokens: float | None = None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    precision: Precision = contextlib.nullcontext,
) -> tuple[float, list[dict[str, torch.Tensor]]]:
    """Forward + backward of ``loss = sum over micro-batches and tokens of token_loss / total_tokens``.

    ``token_loss(mb, logp, entropy)`` -> (per-token loss (b, response_len) with masked tokens zeroed, metrics).
    ``total_tokens`` defaults to the sum of ``mb.loss_mask`` over all micro-batches. With Megatron DDP and
    DP > 1 (which averages gradients over DP ranks) pass the global token count divided by the DP size.
    Gradients accumulate (param.grad, or main_grad under Megatron DDP): zero them before.
    Returns (loss, per-micro-batch metrics with ``loss_sum``); the loss is broadcast to every pipeline rank,
    the metrics exist on the last stage only.
    """
    if total_tokens is None:
        total_tokens = float(sum(float(mb.loss_mask.sum()) for mb in microbatches))
    total_tokens = max(float(total_tokens), 1.0)
    scale = len(microbatches) / total_tokens

    def loss_func(mb, output):
        logp, entropy = response_logprobs(mb, output, temperature, vocab_size)
        per_token, metrics = token_loss(mb, logp, entropy)
        token_sum = per_token.sum()
        return token_sum * scale, {**metrics, "loss_sum": token_sum.detach()}

    def forward_step(data_iterator, model):
        output, mb = _forward_step(precision, data_iterator, model)
        return output, partial(loss_func, mb)

    store = _run_schedule(model, microbatches, forward_step, precision, forward_only=False, collect_non_loss_data=False)
    loss = torch.zeros(1, dtype=torch.float64)
    if parallel_state.is_pipeline_last_stage():
        loss[0] = sum(float(item["loss_sum"]) for item in store) / total_tokens
    dist.broadcast(
        loss,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return float(loss), store


def pipeline_forward_backward(
    model: torch.nn.Module,
    microbatches: list[Sequences],
    loss_fn: Callable[[Sequences, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, float]]],
    temperature: float,
    vocab_size: int | None,
    logprobs_fn: LogprobsFn | None = None,
    precision: Precision = contextlib.nullcontext,
) -> tuple[list[dict[str, float]], list[torch.Tensor]]:
    """Forward + backward of ``sum over micro-batches of loss_fn(mb, logp, entropy)`` through the schedule
    (each loss already normalised for the whole mini-batch by the caller; the schedule divides a loss by the
    number of micro-batches, so it is handed back multiplied by it). Returns each micro-batch's metrics and its
    detached log-probs, broadcast from the last stage to every pipeline rank."""
    stash: list[tuple[dict[str, float], torch.Tensor]] = []
    count = len(microbatches)

    def loss_func(mb, output):
        logp, entropy = _score(logprobs_fn, mb, output, temperature, vocab_size)
        loss, metrics = loss_fn(mb, logp, entropy)
        stash.append(({**metrics, "loss_finite": float(torch.isfinite(loss))}, logp.detach()))
        return loss * count, {}

    def forward_step(data_iterator, model):
        output, mb = _forward_step(precision, data_iterator, model)
        return output, partial(loss_func, mb)

    _run_schedule(model, microbatches, forward_step, precision, forward_only=False, collect_non_loss_data=False)
    shapes = [(mb.input_ids.shape[0], mb.response_len) for mb in microbatches]
    logps = broadcast_from_last_stage([lp for _, lp in stash] if stash else None, shapes)
    box = [[m for m, _ in stash]]
    dist.broadcast_object_list(
        box,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return box[0], logps


def pipeline_next_logits(model: torch.nn.Module) -> Callable:
    """`fp8rl.models.generate`'s next-token logits through the stages: each stage runs its layers with its own
    KV cache on the activations the previous stage sends; the last stage's (b, vocab) logits of the new
    tokens' last position are broadcast to every stage, so every rank samples the same tokens."""
    module = getattr(model, "module", model)
    group = parallel_state.get_pipeline_model_parallel_group()
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()

    def next_logits(input_ids, position_ids, mask, ctx, vocab_size):
        batch, q = input_ids.shape
        dtype = activation_dtype(model, contextlib.nullcontext)
        with cpu_schedule_shims():
            if not first:
                hidden = torch.empty(q, batch, module.config.hidden_size, dtype=dtype, device=input_ids.device)
                dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank(), group=group)
                module.set_input_tensor(hidden)
            output = module(input_ids, position_ids, mask, inference_context=ctx, runtime_gather_output=True)
            if not last:
                dist.send(output.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank(), group=group)
        width = module.vocab_size if vocab_size is None else vocab_size
        logits = output[:, -1, :width].float().contiguous() if last else torch.empty(batch, width)
        dist.broadcast(logits, src=parallel_state.get_pipeline_model_parallel_last_rank(), group=group)
        return logits

    return next_logits


def pipeline_generate(model: torch.nn.Module, prompt_ids, prompt_mask, sampling, seeds):
    """KV-cached sampling over the pipeline stages (`pipeline_next_logits`)."""
    from fp8rl.models.generate import generate

    return generate(model, prompt_ids, prompt_mask, sampling, seeds, next_logits=pipeline_next_logits(model))


def gather_stages(model: torch.nn.Module, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole model's state from every stage's (TP-gathered) tensors, under the PP = 1 names, on every rank."""
    module = getattr(model, "module", model)
    offset, _ = stage_layer_range(module.config)
    renamed = {global_key(key, offset): value.detach().cpu() for key, value in local.items()}
    parts: list[dict[str, torch.Tensor] | None] = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(parts, renamed, group=parallel_state.get_pipeline_model_parallel_group())
    full: dict[str, torch.Tensor] = {}
    for part in parts:
        full.update(part or {})
    return full
