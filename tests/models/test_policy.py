"""The policy on this rank (fp8rl.models.policy): scoring in micro-batches."""

from __future__ import annotations

import torch

from fp8rl.models.dims import SINGLE
from fp8rl.models.policy import build_policy


def test_scoring_in_micro_batches_gives_the_whole_batchs_logprobs(megatron: None, tiny_cfg) -> None:
    """A GPU rank scores its batch a micro-batch at a time; the rows' log-probs and entropies are the same."""
    policy = build_policy(tiny_cfg, None, seed=0, device=torch.device("cpu"), dims=SINGLE)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, tiny_cfg.vocab_size, (5, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded prompt
    whole = policy.logprobs(ids, mask, 6, 1.0, None)
    parts = policy.logprobs(ids, mask, 6, 1.0, None, micro_batch_size=2)
    for a, b in zip(whole, parts, strict=True):
        assert a.shape == b.shape == (5, 6)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
