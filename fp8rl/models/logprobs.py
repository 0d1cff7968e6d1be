"""Per-token log-probs and entropy of response tokens under a megatron GPTModel.

Batch layout the trainer should use (verl's): ``input_ids = [prompt | response]`` with prompts
LEFT-padded and responses RIGHT-padded, so every response starts at the same column and the last
``response_len`` columns are the response. ``attention_mask`` (b, s) is 1 on real tokens, 0 on pads.

Masking: megatron's local attention takes a boolean (b, 1, sq, sk) mask, True = masked; we pass
causal AND key-is-pad. A Transformer Engine model takes the (b, s) token mask instead (it packs the batch,
`fp8rl.models.te_backend`): `model_attention_mask` picks, so the O(b s^2) mask is never built for it.
RoPE in megatron's GPTModel ignores ``position_ids`` (it rotates by column index); because RoPE scores depend
only on the distance between query and key, a left-padded row gives the same scores as the unpadded sequence.
``position_ids`` are still passed (from the mask) so a learned-absolute embedding would also be right.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


class Sequences(Protocol):
    """A micro-batch the model scores: ids and mask (b, s) in the layout above, the last `response_len`
    columns the response; the caller's loss reads whatever else it carries (the trainer's ``MicroBatch``)."""

    input_ids: Tensor
    attention_mask: Tensor
    response_len: int


@dataclass(frozen=True)
class SequenceBatch:
    """The plain `Sequences`: what the model scores and nothing else."""

    input_ids: Tensor
    attention_mask: Tensor
    response_len: int


def causal_padding_mask(attention_mask: Tensor) -> Tensor:
    """(b, s) with 1 = token, 0 = pad -> (b, 1, s, s) bool, True where the key is in the future or a pad."""
    seq_len = attention_mask.size(1)
    future = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=attention_mask.device), diagonal=1)
    pad_key = ~attention_mask.bool()[:, None, None, :]
    return future[None, None] | pad_key


def is_te_model(model: torch.nn.Module) -> bool:
    """Built by `fp8rl.models.te_backend` (Transformer Engine layers), inside Megatron's DDP wrapper or not."""
    return getattr(getattr(model, "module", model), "fp8rl_backend", None) == "te"


def model_attention_mask(model: torch.nn.Module, attention_mask: Tensor) -> Tensor:
    """The mask `model` takes for a padded batch (attention_mask (b, s), 1 = token): the (b, s) token mask for a
    Transformer Engine model, which packs the batch from it (the (b, 1, s, s) mask would be 268 MB of bools per
    16K-token row, built only to read its last row back), else the local spec's causal | key-is-pad mask."""
    return attention_mask.bool() if is_te_model(model) else causal_padding_mask(attention_mask)


def decode_step_mask(attention_mask: Tensor) -> Tensor:
    """Mask for one new query over all cached keys: (b, k) with 1 = token -> (b, 1, 1, k) bool, True = masked."""
    return ~attention_mask.bool()[:, None, None, :]


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """(b, s) -> (b, s) long: 0, 1, 2, ... over the real tokens of each row, 0 on left pads."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def forward_logits(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Logits of ``model`` for a padded batch: input_ids (b, s), attention_mask (b, s) -> (b, s, vocab)."""
    logits = model(input_ids, position_ids_from_mask(attention_mask), model_attention_mask(model, attention_mask))
    if is_te_model(model):  # TP-sharded vocabulary
        from fp8rl.models.te_backend import gather_vocab_parallel

        logits = gather_vocab_parallel(logits)
    return logits


def logprobs_and_entropy_from_logits(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """log pi(token) and entropy of pi = softmax(logits / temperature), both in fp32.

    logits (..., vocab), tokens (...) -> (logp (...), entropy (...)).
    """
    scaled = logits.float() / temperature
    log_probs = F.log_softmax(scaled, dim=-1)
    token_logp = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    return token_logp, entropy


def token_logprobs_and_entropy(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_len: int,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Log-prob and entropy of the last ``response_len`` tokens of each row.

    input_ids, attention_mask: (b, s) in the layout described in the module docstring.
    Returns (logp, entropy), each (b, response_len) fp32; values at response pads are meaningless
    and must be masked by the caller (``attention_mask[:, -response_len:]``).
    ``temperature`` and ``vocab_size`` (softmax over the first ``vocab_size`` logit rows, the
    tokenizer's; None = all, padding rows included) must match the rollout's so that the ratio
    compares the same distributions.
    """
    if not 0 < response_len < input_ids.size(1):
        raise ValueError(f"response_len={response_len} must be in (0, {input_ids.size(1)})")
    logits = forward_logits(model, input_ids, attention_mask)
    # The logit at column t predicts token t + 1.
    response_logits = logits[:, -response_len - 1 : -1, :vocab_size]
    return logprobs_and_entropy_from_logits(response_logits, input_ids[:, -response_len:], temperature)


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad token lists -> (input_ids (b, s) long, attention_mask (b, s) long, 1 = token)."""
    width = max(len(seq) for seq in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq:
            input_ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            attention_mask[row, width - len(seq) :] = 1
    return input_ids, attention_mask
