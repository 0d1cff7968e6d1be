"""Per-token log-probs and entropy from vocabulary-parallel logits, without gathering the vocabulary.

With tensor parallelism megatron's output layer leaves the logits split over the TP ranks along the
vocabulary (``parallel_output=True``): rank r holds columns ``[vocab_start, vocab_end)``. The policy loss
needs, per token, log pi(token) and the entropy of pi = softmax(logits / T). Both come from three
per-token sums, so they cost one all-reduce MAX (the row max) and one all-reduce SUM of three floats per
token, never a gather of the full vocabulary:

    m = max_v z_v,  S = sum_v e^(z_v - m),  A = sum_v e^(z_v - m) (z_v - m),  z = logits / T
    log pi(t) = (z_t - m) - log S,          H = log S - A / S

The backward is local (no communication), with p = softmax(z):

    d log pi(t) / d z_v = 1[v = t] - p_v,   d H / d z_v = -p_v (log p_v + H)

The result equals ``fp8rl.models.logprobs.logprobs_and_entropy_from_logits`` on the gathered logits
(tests/models/test_vocab_parallel.py: within 1e-6 + 4e-7 |value| of a float64 reference, gradients within
1e-6, on one rank and split unevenly over two gloo ranks). Measured on a tiny GPT's TP=2 logits: 4.3e-7
from float64 for the entropy, where the full-vocabulary fp32 function was 1.2e-6 away.
Unlike megatron's ``vocab_parallel_cross_entropy`` it does not modify the logits in place, takes a
temperature and a process group, returns the entropy, and can leave out padding rows (``vocab_size``).

``vocab_parallel_logprobs_and_entropy`` is pure torch (``torch.distributed`` only; without an initialized
process group it computes locally); ``tp_token_logprobs_and_entropy`` imports megatron when called.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _all_reduce(tensor: Tensor, op, group) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=op, group=group)


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, temperature: float, vocab_start: int, group):
        z = logits.float() / temperature
        width = z.shape[-1]
        if width:
            row_max = z.amax(dim=-1)
        else:  # every column of this shard is a padding row past vocab_size
            row_max = torch.full(z.shape[:-1], float("-inf"), dtype=torch.float32, device=z.device)
        _all_reduce(row_max, dist.ReduceOp.MAX, group)
        shifted = z - row_max.unsqueeze(-1)
        exp = shifted.exp()
        local = tokens - vocab_start
        owned = (local >= 0) & (local < width)
        index = local.clamp(0, max(width - 1, 0)).unsqueeze(-1)
        if width:
            target = torch.where(owned, shifted.gather(-1, index).squeeze(-1), 0.0)
        else:
            target = torch.zeros_like(row_max)
        sums = torch.stack([exp.sum(dim=-1), (exp * shifted).sum(dim=-1), target])
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        sum_exp, sum_exp_shifted, target_shifted = sums.unbind(0)
        log_sum_exp = sum_exp.log()
        logp = target_shifted - log_sum_exp
        entropy = log_sum_exp - sum_exp_shifted / sum_exp
        ctx.save_for_backward(shifted, log_sum_exp, entropy, index, owned)
        ctx.temperature, ctx.logits_dtype = temperature, logits.dtype
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_entropy: Tensor):
        shifted, log_sum_exp, entropy, index, owned = ctx.saved_tensors
        log_p = shifted - log_sum_exp.unsqueeze(-1)
        p = log_p.exp()
        grad = -p * (grad_logp.unsqueeze(-1) + grad_entropy.unsqueeze(-1) * (log_p + entropy.unsqueeze(-1)))
        if grad.shape[-1]:
            grad.scatter_add_(-1, index, torch.where(owned, grad_logp, 0.0).unsqueeze(-1))
        grad = grad / ctx.temperature
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_logprobs_and_entropy(
    logits_shard: Tensor,
    tokens: Tensor,
    temperature: float,
    vocab_start: int,
    vocab_end: int,
    group=None,
    vocab_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """log pi(token) and entropy of pi = softmax(logits / temperature) from this rank's vocabulary columns.

    Args:
        logits_shard: (..., vocab_end - vocab_start), columns [vocab_start, vocab_end) of the logits.
        tokens: (...) global token ids (owned by any rank of the group).
        temperature: the rollout's sampling temperature.
        vocab_start, vocab_end: this rank's column range (megatron: tp_rank * width, (tp_rank + 1) * width).
        group: the tensor-parallel process group (None = the default group).
        vocab_size: softmax over the first ``vocab_size`` global rows only (the tokenizer's, padding rows
            left out, as ``token_logprobs_and_entropy(vocab_size=...)``); None = all rows.

    Returns:
        (logp, entropy), each (...) float32, identical on every rank of the group; both carry gradients to
        ``logits_shard`` (in its dtype).
    """
    if logits_shard.shape[-1] != vocab_end - vocab_start:
        raise ValueError(
            f"logits_shard has {logits_shard.shape[-1]} columns, vocab_end - vocab_start = {vocab_end - vocab_start}"
        )
    if vocab_size is not None:
        logits_shard = logits_shard[..., : max(0, min(vocab_end, vocab_size) - vocab_start)]
    return _VocabParallelLogprobEntropy.apply(logits_shard, tokens, temperature, vocab_start, group)


def tp_token_logprobs_and_entropy(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_len: int,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``fp8rl.models.logprobs.token_logprobs_and_entropy`` for a megatron model with TP-split logits.

    Same layout, arguments and result. The model is called directly (not through ``forward_logits``, which
    gathers a Transformer Engine model's logits), so the logits stay vocabulary-parallel; the column range
    comes from megatron's TP rank and the shard width (megatron splits the padded vocabulary evenly).
    """
    from megatron.core import parallel_state

    from fp8rl.models.logprobs import model_attention_mask, position_ids_from_mask

    if not 0 < response_len < input_ids.size(1):
        raise ValueError(f"response_len={response_len} must be in (0, {input_ids.size(1)})")
    logits = model(input_ids, position_ids_from_mask(attention_mask), model_attention_mask(model, attention_mask))
    width = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * width
    return vocab_parallel_logprobs_and_entropy(
        logits[:, -response_len - 1 : -1, :],
        input_ids[:, -response_len:],
        temperature,
        start,
        start + width,
        parallel_state.get_tensor_model_parallel_group(),
        vocab_size,
    )
