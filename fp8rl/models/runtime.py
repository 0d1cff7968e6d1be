"""Megatron's process-wide state, set up once per process, before any model is built.

`init_megatron(tensor_parallel, pipeline_parallel, seed)` is what a job calls first (every rank of it):

1. torch.distributed: left as the launcher made it (torchrun / Slurm, `fp8rl.job.distributed`), or a
   one-rank group over an in-process store (gloo on CPU, NCCL on GPU) when nothing started one;
2. megatron's ``parallel_state`` with the run's layout (TP x PP, DP = world / (TP x PP));
3. its RNG tracker, seeded from ``seed`` (on CPU a tracker over the CPU generator);
4. on a CPU host, the shims of `fp8rl.models.cpu_compat` (megatron assumes CUDA in a few places), and with
   several ranks those of `fp8rl.models.distributed_compat` (Megatron DDP, its optimizers, TP linears).

A second call with the same layout only re-seeds; another layout raises (megatron's groups exist once
per process). Building a model (`fp8rl.models.gpt.build_gpt_model`) requires this and never does it
itself, so no model build patches the process behind a caller's back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as mcore_random

from fp8rl.models import cpu_compat


def process_group_backend(use_cuda: bool) -> str:
    """gloo on a CPU host; on a GPU host NCCL for CUDA tensors and gloo for CPU ones.

    An NCCL-only group refuses CPU tensors ("No backend type associated with device type cpu"), and the trainer
    reduces some on the host (the finite-gradient flag, metric dicts, gathered lengths). Megatron creates its
    groups with ``backend=None`` (parallel_state.create_group, megatron-core 0.16.1), so they inherit both.
    """
    return "cpu:gloo,cuda:nccl" if use_cuda else "gloo"


def init_megatron(tensor_parallel: int = 1, pipeline_parallel: int = 1, seed: int = 0) -> None:
    """Set up torch.distributed (if needed), megatron's parallel groups, its RNG, and the CPU shims."""
    if not dist.is_initialized():
        backend = process_group_backend(torch.cuda.is_available())
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    if parallel_state.model_parallel_is_initialized():
        current = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
        if current != (tensor_parallel, pipeline_parallel):
            raise RuntimeError(
                f"megatron is already initialised with TP x PP = {current[0]} x {current[1]} in this process; "
                f"it cannot change to {tensor_parallel} x {pipeline_parallel}"
            )
    else:
        world = dist.get_world_size()
        if world % (tensor_parallel * pipeline_parallel):
            raise RuntimeError(
                f"world size {world} is not a multiple of TP x PP = {tensor_parallel} x {pipeline_parallel}"
            )
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel
        )
    if not torch.cuda.is_available():
        cpu_compat.apply_cpu_shims()
        if dist.get_world_size() > 1:
            from fp8rl.models.distributed_compat import apply_cpu_multirank_shims

            apply_cpu_multirank_shims()
    seed_megatron_rng(seed)


def megatron_initialized() -> bool:
    """Whether `init_megatron` (or an equivalent setup) ran in this process."""
    return dist.is_initialized() and parallel_state.model_parallel_is_initialized()


def require_megatron() -> None:
    """Raise a clear error when megatron's process state is missing."""
    if not megatron_initialized():
        raise RuntimeError(
            "megatron is not initialised in this process: call fp8rl.models.runtime.init_megatron(...) first "
            "(the job does it, with the run's parallel layout)"
        )


def seed_megatron_rng(seed: int) -> None:
    """Restart megatron's named RNG streams (dropout, model-parallel init) from `seed`."""
    if torch.cuda.is_available():
        mcore_random.model_parallel_cuda_manual_seed(seed)
    else:
        cpu_compat.install_cpu_rng_tracker(seed)
