"""One shared loss aggregation, chosen by config (verl's ``agg_loss``).

``aggregate_loss(per_token_loss, response_mask, mode)`` reduces a (batch, response_len) per-token loss to a
scalar. With m the mask, l the loss, T = response_len, B = batch:

- ``"token-mean"``: sum_{i,t} m l / sum_{i,t} m -- every token of the batch weighs the same
  (DAPO's token-level loss, Yu et al. 2025, eq. 12).
- ``"seq-mean-token-mean"``: mean over sequences of (sum_t m l / sum_t m) -- the original GRPO objective.
- ``"seq-mean-token-sum"``: mean over sequences of sum_t m l.
- ``"seq-mean-token-sum-norm"``: sum_{i,t} m l / (B * norm_constant), norm_constant defaults to T = the
  (max) response length: a constant normaliser as in Dr.GRPO (Liu et al. 2025). Pass the configured max
  response length as ``norm_constant`` so it stays constant across batches of different padding. Unlike
  verl (which divides the sum over sequences by T only) this is a mean over the B rows, so the loss scale
  does not grow with the batch size.

Project choices: in the two data-dependent ``seq-mean`` modes, sequences without any masked token (dropped
by dynamic sampling or MIS) are left out of the sequence mean; ``seq-mean-token-sum-norm`` keeps its
constant denominator. An all-masked input returns 0 that still carries a (zero) gradient, never NaN.
Masked-out entries of ``per_token_loss`` are never read, so they may hold NaN or inf.
"""

from __future__ import annotations

import torch

from fp8rl.algos.masked import as_bool_mask, masked_sum, safe_div

AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate_loss(
    per_token_loss: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    norm_constant: float | None = None,
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a (batch, response_len) per-token loss over ``response_mask`` to a 0-d tensor.

    Args:
        per_token_loss: (batch, response_len).
        response_mask: (batch, response_len), nonzero = token counts.
        mode: one of :data:`AGGREGATION_MODES`.
        norm_constant: divisor per sequence for ``"seq-mean-token-sum-norm"`` (default response_len).
        denominator: the normaliser to divide by instead of this batch's own (:func:`aggregation_count`): the
            count of the whole global mini-batch when it is split over data-parallel ranks and micro-batches
            (verl's global-batch normalisation), so that the sum of the parts' losses is the whole's loss.
    """
    if per_token_loss.shape != response_mask.shape or per_token_loss.dim() != 2:
        raise ValueError(
            f"per_token_loss {tuple(per_token_loss.shape)} and response_mask {tuple(response_mask.shape)} "
            "must both be (batch, response_len)"
        )
    mask = as_bool_mask(response_mask)
    if denominator is None:
        denominator = aggregation_count(response_mask, mode, norm_constant=norm_constant)
    denominator = torch.as_tensor(denominator, dtype=per_token_loss.dtype, device=per_token_loss.device)
    if mode in ("token-mean", "seq-mean-token-sum-norm"):
        return safe_div(masked_sum(per_token_loss, mask), denominator)
    token_count = mask.sum(-1).to(per_token_loss.dtype)
    seq_loss = masked_sum(per_token_loss, mask, dim=-1)
    if mode == "seq-mean-token-mean":
        seq_loss = safe_div(seq_loss, token_count)
    return safe_div(masked_sum(seq_loss, token_count > 0), denominator)


def aggregation_count(response_mask: torch.Tensor, mode: str, *, norm_constant: float | None = None) -> float:
    """The normaliser of ``mode`` for a (batch, response_len) mask: its token count (token-mean), its sequences
    with at least one token (the seq-mean modes), or batch x norm_constant (seq-mean-token-sum-norm)."""
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {', '.join(sorted(AGGREGATION_MODES))}")
    mask = as_bool_mask(response_mask)
    if mode == "token-mean":
        return float(mask.sum())
    if mode == "seq-mean-token-sum-norm":
        constant = response_mask.shape[-1] if norm_constant is None else norm_constant
        if constant <= 0:
            raise ValueError(f"norm_constant must be positive, got {constant}")
        return float(response_mask.shape[0] * constant)
    return float((mask.sum(-1) > 0).sum())
