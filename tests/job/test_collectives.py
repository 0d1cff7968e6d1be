"""The process groups a GPU job creates serve every collective the trainer makes (issue: CPU tensors on NCCL
groups). Modelled on CPU with `tests/support/collectives.py`: one RL step whose collectives are checked against
the backend spec of a GPU host."""

from __future__ import annotations

import contextlib

import pytest
import torch

from fp8rl.models.runtime import process_group_backend
from tests.support.collectives import devices_checked, served_device_types


def test_a_gpu_host_creates_groups_that_serve_cuda_and_host_tensors() -> None:
    assert served_device_types(process_group_backend(use_cuda=True)) == {"cpu", "cuda"}
    assert process_group_backend(use_cuda=False) == "gloo"


def _optimizer_step_under_each_spec(rank: int, store_path: str) -> None:
    """In a fresh process (Megatron DDP needs the CPU shims, which stay for the process's life)."""
    import torch.distributed as dist

    from fp8rl.models.config import get_model_config, with_tokenizer_vocab
    from fp8rl.models.distributed_compat import apply_cpu_multirank_shims
    from fp8rl.models.gpt import build_gpt_model
    from fp8rl.models.runtime import init_megatron
    from fp8rl.trainer.optim import megatron_policy_optimizer

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 1), rank=0, world_size=1)
    init_megatron()
    apply_cpu_multirank_shims()
    model = build_gpt_model(with_tokenizer_vocab(get_model_config("tiny"), 16), seed=0)
    ddp_model, optimizer = megatron_policy_optimizer(model, 1e-4, 0.0, distributed=False, bf16=False)
    tokens = torch.randint(0, 16, (2, 8))
    position_ids = torch.arange(8).expand(2, 8)
    for spec, raises in ((process_group_backend(use_cuda=True), False), ("nccl", True)):
        optimizer.zero_grad()
        ddp_model(tokens, position_ids, None).float().square().mean().backward()
        refused = pytest.raises(RuntimeError, match=r"all_reduce of a tensor on \['cpu'\] on a 'nccl' group")
        with refused if raises else contextlib.nullcontext(), devices_checked(spec) as seen:
            optimizer.clip_and_step(1.0)
        assert "all_reduce['cpu']" in seen, seen


def test_the_megatron_optimizer_step_reduces_a_host_flag_that_an_nccl_only_group_refuses(tmp_path) -> None:
    """Every GPU job steps through Megatron's optimizer (TE backend, or several ranks), whose finite-gradient flag
    is reduced on the host: the GPU host's groups serve it; on NCCL-only groups (what the job created before) the
    first optimizer step fails."""
    torch.multiprocessing.spawn(_optimizer_step_under_each_spec, args=(str(tmp_path / "store"),), nprocs=1)


def test_the_checker_passes_device_tensors_on_nccl(megatron: None) -> None:
    with devices_checked("nccl", device_type_of=lambda t: "cuda") as seen:
        torch.distributed.all_reduce(torch.zeros(1))
    assert seen == ["all_reduce['cuda']"]
