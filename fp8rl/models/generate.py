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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from megatron.core.inference.contexts import StaticInferenceContext
from torch import Tensor

from fp8rl.models.logprobs import (
    causal_padding_mask,
    decode_step_mask,
    logprobs_and_entropy_from_logits,
    position_ids_from_mask,
)
from fp8rl.models.sampling import SamplingConfig

# (new token ids (b, q), position ids, attention mask, KV-cache context, vocab limit) -> last logits (b, vocab)
NextLogits = Callable[[Tensor, Tensor, Tensor, StaticInferenceContext, "int | None"], Tensor]


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


def row_uniforms(seeds: Sequence[int], steps: int, device: torch.device | str = "cpu") -> Tensor:
    """(len(seeds), steps) uniforms in [0, 1): row i drawn from a generator seeded with seeds[i]."""
    rows = [torch.rand(steps, generator=torch.Generator().manual_seed(int(seed))) for seed in seeds]
    return torch.stack(rows).to(device) if rows else torch.zeros(0, steps, device=device)


def sample_tokens(logits: Tensor, cfg: SamplingConfig, uniforms: Tensor | None) -> Tensor:
    """One token per row from (b, v) logits -> (b,) long.

    With ``uniforms`` (b,) in [0, 1), row i takes the token where its uniform falls in the cumulative
    distribution (inverse-CDF sampling): a row's draw depends on its own uniform only, not on the other rows
    of the batch. Without, ``torch.multinomial`` draws from the global generator.
    """
    if cfg.temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)
    probs = top_p_filter(probs, cfg.top_p)
    if uniforms is None:
        return torch.multinomial(probs, num_samples=1).squeeze(-1)
    cdf = probs.cumsum(dim=-1)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


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
    seeds: Sequence[int] | None = None,
    next_logits: NextLogits | None = None,
) -> GenerationOutput:
    """Sample up to ``cfg.max_new_tokens`` tokens after each LEFT-padded prompt.

    prompt_ids, prompt_mask: (b, p), mask 1 = token. ``seeds``: one per row (see `sample_tokens`).
    ``next_logits``: how the new tokens' last logits are computed (default: one forward of `model`; a pipeline
    of stages passes its own). The model is put in eval mode for the call (megatron uses the KV cache only
    then) and restored.
    """
    next_logits = next_logits or partial(_last_token_logits, model)
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
        logits = next_logits(prompt_ids, prompt_positions, prompt_attention, ctx, cfg.vocab_size)
        ctx.sequence_len_offset = prompt_len
        ctx.enable_decode_mode()
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        stop_ids = torch.tensor(cfg.eos_token_ids, dtype=torch.long, device=device)
        uniforms = None if seeds is None else row_uniforms(seeds, cfg.max_new_tokens, device)
        for step in range(cfg.max_new_tokens):
            token = sample_tokens(logits, cfg, None if uniforms is None else uniforms[:, step])
            logp, entropy = logprobs_and_entropy_from_logits(logits, token, cfg.temperature or 1.0)
            alive = ~finished
            out.tokens[:, step] = torch.where(alive, token, cfg.pad_token_id)
            out.logprobs[:, step] = torch.where(alive, logp, 0.0)
            out.entropy[:, step] = torch.where(alive, entropy, 0.0)
            out.response_mask[:, step] = alive.long()
            finished |= torch.isin(token, stop_ids)
            if bool(finished.all()) or step + 1 == cfg.max_new_tokens:
                break
            seen = key_mask[:, : prompt_len + step + 1]
            position = seen.sum(dim=1, keepdim=True) - 1
            new_token = out.tokens[:, step : step + 1]
            logits = next_logits(new_token, position, decode_step_mask(seen), ctx, cfg.vocab_size)
            ctx.sequence_len_offset += 1
    finally:
        model.train(was_training)
    return out
