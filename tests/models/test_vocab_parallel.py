"""vocab_parallel_logprobs_and_entropy: equal to the full-vocabulary log-probs / entropy and their gradients,
on one rank and split over two gloo ranks (spawned processes; torch only, no megatron)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fp8rl.models.logprobs import logprobs_and_entropy_from_logits
from fp8rl.models.vocab_parallel import vocab_parallel_logprobs_and_entropy

VOCAB = 40


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(3, 5, VOCAB, generator=g)
    tokens = torch.randint(0, VOCAB, (3, 5), generator=g)
    grad_logp, grad_entropy = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    return logits, tokens, grad_logp, grad_entropy


def _float64_truth(logits, tokens, temperature, vocab_size, grad_logp, grad_entropy):
    """log pi(token), entropy and d(<g_logp, logp> + <g_ent, H>)/d logits, all in float64."""
    full = logits.double().requires_grad_(True)
    log_probs = torch.log_softmax(full[..., :vocab_size] / temperature, dim=-1)
    logp = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    ((logp * grad_logp.double()).sum() + (entropy * grad_entropy.double()).sum()).backward()
    return logp.detach(), entropy.detach(), full.grad


def _check(logits, tokens, temperature, vocab_size, grad_logp, grad_entropy, start, end, group):
    """This rank's columns [start, end) against the float64 truth and fp8rl's full-vocabulary function."""
    if vocab_size is not None:
        tokens = tokens.clamp(max=vocab_size - 1)
    shard = logits[..., start:end].clone().requires_grad_(True)
    logp, entropy = vocab_parallel_logprobs_and_entropy(shard, tokens, temperature, start, end, group, vocab_size)
    ((logp * grad_logp).sum() + (entropy * grad_entropy).sum()).backward()
    truth_logp, truth_entropy, truth_grad = _float64_truth(
        logits, tokens, temperature, vocab_size, grad_logp, grad_entropy
    )
    ref_logp, ref_entropy = logprobs_and_entropy_from_logits(logits[..., :vocab_size], tokens, temperature)
    assert logp.dtype == entropy.dtype == torch.float32
    # fp32 round-off: 1e-6 absolute plus 4e-7 relative (|logp| reaches ~20 here; z = logits / T is already
    # rounded to fp32, about 1 ulp = 6e-8 relative)
    close = dict(atol=1e-6, rtol=4e-7)
    torch.testing.assert_close(logp.detach().double(), truth_logp, **close)
    torch.testing.assert_close(entropy.detach().double(), truth_entropy, **close)
    torch.testing.assert_close(logp.detach(), ref_logp, atol=2e-6, rtol=8e-7)
    torch.testing.assert_close(entropy.detach(), ref_entropy, atol=2e-6, rtol=8e-7)
    torch.testing.assert_close(shard.grad.double(), truth_grad[..., start:end], atol=1e-6, rtol=0)


@pytest.mark.parametrize(("temperature", "vocab_size"), [(1.0, None), (0.7, 33)])
def test_one_rank_equals_full_vocabulary(temperature, vocab_size):
    logits, tokens, grad_logp, grad_entropy = _data()
    _check(logits, tokens, temperature, vocab_size, grad_logp, grad_entropy, 0, VOCAB, None)


def test_bf16_logits_get_bf16_gradients_and_fp32_results():
    logits, tokens, _, _ = _data()
    shard = logits.bfloat16().requires_grad_(True)
    logp, entropy = vocab_parallel_logprobs_and_entropy(shard, tokens, 1.0, 0, VOCAB)
    (logp.sum() + entropy.sum()).backward()
    assert logp.dtype == torch.float32 and shard.grad.dtype == torch.bfloat16
    ref_logp, _ = logprobs_and_entropy_from_logits(shard.detach(), tokens)
    torch.testing.assert_close(logp.detach(), ref_logp, atol=2e-6, rtol=8e-7)


def test_rejects_a_shard_of_the_wrong_width():
    logits, tokens, _, _ = _data()
    with pytest.raises(ValueError, match="columns"):
        vocab_parallel_logprobs_and_entropy(logits[..., :10], tokens, 1.0, 0, 20)


# Uneven on purpose (the function does not assume megatron's even split); vocab_size=20 leaves rank 1 with
# no column at all, vocab_size=33 with 8 of its 15.
SPLITS = [(0, 25), (25, VOCAB)]
CASES = [(1.0, None), (0.7, 33), (1.3, 20)]


def _worker(rank: int, store_path: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        logits, tokens, grad_logp, grad_entropy = _data()
        start, end = SPLITS[rank]
        for temperature, vocab_size in CASES:
            _check(logits, tokens, temperature, vocab_size, grad_logp, grad_entropy, start, end, None)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_equal_full_vocabulary(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "store"),), nprocs=2, join=True)
