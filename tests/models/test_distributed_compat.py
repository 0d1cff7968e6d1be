"""distributed_compat: megatron TP (fp32 and CPU bf16 autocast), DDP and the distributed optimizer on two
spawned gloo ranks, against one-process references computed in the same workers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fp8rl.models.distributed_compat import CudaArgsToCpu

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the shims are not applied on a CUDA host")


def test_cuda_args_to_cpu_maps_devices_cuda_calls_and_type_names():
    p = torch.nn.Parameter(torch.zeros(3))
    with CudaArgsToCpu():
        assert torch.zeros(1, device="cuda").device.type == "cpu"
        assert torch.tensor([1.0], device=0).device.type == "cpu"
        assert p.cuda() is p
        assert p.type() == "torch.cuda.FloatTensor"
        assert p.bfloat16().type() == "torch.cuda.BFloat16Tensor"
    assert p.type() == "torch.FloatTensor"


RESP = 6


def _cfg():
    from fp8rl.models.config import ModelConfig

    return ModelConfig(
        name="dist_compat_probe",
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        vocab_size=128,
        max_seq_len=16,
        head_dim=16,
        rotary_base=10_000.0,
    )


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (4, 12), generator=g)
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[1, :2] = 0
    mask[3, -2:] = 0  # rows with different numbers of response tokens
    return ids, mask, torch.randn(4, RESP, generator=g)


def _token_sum(logp, entropy, weights, mask):
    m = mask[:, -RESP:].float()
    return ((weights * logp + 0.01 * entropy) * m).sum()


def _worker(rank: int, store_path: str) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import random as mcore_random

    from fp8rl.models.distributed_compat import apply_cpu_multirank_shims
    from fp8rl.models.gpt import build_gpt_model, compute_precision
    from fp8rl.models.logprobs import token_logprobs_and_entropy
    from fp8rl.models.vocab_parallel import tp_token_logprobs_and_entropy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        ids, mask, weights = _batch()
        n_tokens = mask[:, -RESP:].sum()

        # one-process reference (layout TP=1 x DP=2: both ranks compute the whole batch)
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        apply_cpu_multirank_shims()
        ref = build_gpt_model(_cfg(), seed=0)
        ref_logp, ref_entropy = token_logprobs_and_entropy(ref, ids, mask, RESP)
        (_token_sum(ref_logp, ref_entropy, weights, mask) / n_tokens).backward()
        ref_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in ref.parameters())).item()

        # TP=2: vocabulary-parallel log-probs equal the reference; bf16 autocast trains through TP linears
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
        model = build_gpt_model(_cfg(), seed=0)
        states = [None, None]
        tracker = mcore_random.get_cuda_rng_tracker()
        dist.all_gather_object(states, {k: v.sum().item() for k, v in tracker.states_.items()})
        assert (
            states[0][mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME]
            != states[1][mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME]
        )
        assert (
            states[0][mcore_random._DATA_PARALLEL_RNG_TRACKER_NAME]
            == states[1][mcore_random._DATA_PARALLEL_RNG_TRACKER_NAME]
        )
        logp, entropy = tp_token_logprobs_and_entropy(model, ids, mask, RESP)
        m = mask[:, -RESP:].bool()
        assert (logp - ref_logp)[m].abs().max() < 1e-5
        assert (entropy - ref_entropy)[m].abs().max() < 1e-5
        with compute_precision("bf16"):
            logp16, entropy16 = tp_token_logprobs_and_entropy(model, ids, mask, RESP)
        (_token_sum(logp16, entropy16, weights, mask) / n_tokens).backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        assert (logp16 - ref_logp)[m].abs().max() < 0.05

        # DP=2: Megatron DDP summing globally normalised grads + distributed optimizer with clipping
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        model = build_gpt_model(_cfg(), seed=0)
        model.config.calculate_per_token_loss = True  # DDP: gradient scaling 1, SUM over DP
        ddp = DistributedDataParallel(
            config=model.config,
            module=model,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
        )
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=1e-3,
                weight_decay=0.1,
                clip_grad=0.5,
                params_dtype=torch.float32,
                use_distributed_optimizer=True,
            ),
            [ddp],
        )
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        rows = slice(2 * rank, 2 * rank + 2)
        logp, entropy = token_logprobs_and_entropy(ddp, ids[rows], mask[rows], RESP)
        (_token_sum(logp, entropy, weights[rows], mask[rows]) / n_tokens).backward()
        ddp.finish_grad_sync()
        applied, grad_norm, _ = optimizer.step()
        assert applied and abs(grad_norm - ref_norm) < 1e-6
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        other = flat.clone()
        dist.broadcast(other, src=0)
        assert torch.equal(flat, other)
    finally:
        dist.destroy_process_group()


@cpu_only
@pytest.mark.slow
def test_tp_and_dp_on_two_gloo_ranks(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "store"),), nprocs=2, join=True)
