"""Batched sampling with megatron-core's static KV cache (``StaticInferenceContext``), on CPU or GPU.

One prefill forward over the left-padded prompts, then one single-token forward per step that
appends to the per-layer KV cache. The caller chooses the precision of the rollout by wrapping the
call in ``compute_precision(...)`` and/or ``fp8_autocast(model, recipe)``.

Returned log-probs and entropies are those of the temperature-scaled distribution
softmax(logits / T) *before* top-p truncation: that is what ``token_logprobs_and_entropy`` computes
in the trainer, so rollout-vs-trainer ratios (TIS) compare the same distribution. With top_p < 1 a
sampled token's probability under the truncated distribution is higher than reported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.inference.contexts import StaticInferenceContext
from torch import Tensor

from fp8rl.models.logprobs import (
    causal_padding_mask,
    decode_step_mask,
    logprobs_and_entropy_from_logits,
    position_ids_from_mask,
)


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample responses."""

    max_new_tokens: int  # response length limit, EOS included
    eos_token_id: int  # stops a row once sampled (the EOS itself is part of the response)
    pad_token_id: int  # fills a row after its EOS
    temperature: float = 1.0  # 0 = greedy; log-probs then come from softmax(logits)
    top_p: float = 1.0  # nucleus sampling mass; 1 = off
    vocab_size: int | None = None  # sample among token ids < vocab_size (the tokenizer's); None = every logit row

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1 or None, got {self.vocab_size}")


@dataclass
class GenerationOutput:
    """Sampled responses, right-padded with ``pad_token_id`` after EOS."""

    tokens: Tensor  # (b, max_new_tokens) long
    logprobs: Tensor  # (b, max_new_tokens) fp32, log pi_T(token); 0 on pads
    entropy: Tensor  # (b, max_new_tokens) fp32, entropy of pi_T at each step; 0 on pads
    response_mask: Tensor  # (b, max_new_tokens) long, 1 on generated tokens (EOS included)


def top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches ``top_p``. (b, v) -> (b, v)."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


def sample_tokens(logits: Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> Tensor:
    """One token per row from (b, v) logits -> (b,) long."""
    if cfg.temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)
    probs = top_p_filter(probs, cfg.top_p)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def _last_token_logits(
    model: torch.nn.Module,
    input_ids: Tensor,
    position_ids: Tensor,
    mask: Tensor,
    ctx: StaticInferenceContext,
    vocab_size: int | None,
) -> Tensor:
    """(b, q) new tokens -> (b, vocab) logits of the last one; their keys/values are appended to ``ctx``.

    Only the first ``vocab_size`` rows are kept: the embedding's padding rows are never sampled.
    """
    logits = model(input_ids, position_ids, mask, inference_context=ctx, runtime_gather_output=True)
    return logits[:, -1, :vocab_size]


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    cfg: SamplingConfig,
    generator: torch.Generator | None = None,
) -> GenerationOutput:
    """Sample up to ``cfg.max_new_tokens`` tokens after each LEFT-padded prompt.

    prompt_ids, prompt_mask: (b, p), mask 1 = token. ``generator`` seeds the sampling.
    The model is put in eval mode for the call (megatron uses the KV cache only then) and restored.
    """
    batch, prompt_len = prompt_ids.shape
    device = prompt_ids.device
    ctx = StaticInferenceContext(max_batch_size=batch, max_sequence_length=prompt_len + cfg.max_new_tokens)
    key_mask = torch.cat(
        [prompt_mask.long(), torch.ones(batch, cfg.max_new_tokens, dtype=torch.long, device=device)], 1
    )
    out = GenerationOutput(
        tokens=torch.full((batch, cfg.max_new_tokens), cfg.pad_token_id, dtype=torch.long, device=device),
        logprobs=torch.zeros(batch, cfg.max_new_tokens, device=device),
        entropy=torch.zeros(batch, cfg.max_new_tokens, device=device),
        response_mask=torch.zeros(batch, cfg.max_new_tokens, dtype=torch.long, device=device),
    )
    was_training = model.training
    model.eval()
    try:
        prompt_positions = position_ids_from_mask(prompt_mask)
        prompt_attention = causal_padding_mask(prompt_mask)
        logits = _last_token_logits(model, prompt_ids, prompt_positions, prompt_attention, ctx, cfg.vocab_size)
        ctx.sequence_len_offset = prompt_len
        ctx.enable_decode_mode()
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        for step in range(cfg.max_new_tokens):
            token = sample_tokens(logits, cfg, generator)
            logp, entropy = logprobs_and_entropy_from_logits(logits, token, cfg.temperature or 1.0)
            alive = ~finished
            out.tokens[:, step] = torch.where(alive, token, cfg.pad_token_id)
            out.logprobs[:, step] = torch.where(alive, logp, 0.0)
            out.entropy[:, step] = torch.where(alive, entropy, 0.0)
            out.response_mask[:, step] = alive.long()
            finished |= token == cfg.eos_token_id
            if bool(finished.all()) or step + 1 == cfg.max_new_tokens:
                break
            seen = key_mask[:, : prompt_len + step + 1]
            position = seen.sum(dim=1, keepdim=True) - 1
            new_token = out.tokens[:, step : step + 1]
            logits = _last_token_logits(model, new_token, position, decode_step_mask(seen), ctx, cfg.vocab_size)
            ctx.sequence_len_offset += 1
    finally:
        model.train(was_training)
    return out
