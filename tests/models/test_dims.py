"""`ParallelDims`: one object for where a rank is and what it runs (fp8rl.models.dims)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fp8rl.models.dims import SINGLE, ParallelDims
from fp8rl.models.parallel import ParallelLayout, preset_layout


def test_one_process_reductions_are_the_identity() -> None:
    values = torch.tensor([1.0, 2.0])
    assert torch.equal(SINGLE.sum(values), values) and SINGLE.sum(values) is not values
    assert SINGLE.mean_of_floats({"a": 1.5}) == {"a": 1.5}
    assert SINGLE.all_gather_objects("x") == ["x"]
    assert SINGLE.share(6) == slice(0, 6)


def test_a_rank_takes_its_contiguous_share_and_uneven_splits_are_refused() -> None:
    assert ParallelDims(dp=4, dp_rank=2).share(8) == slice(4, 6)
    with pytest.raises(ValueError, match="do not split over 4 data-parallel ranks"):
        ParallelDims(dp=4).share(6)


def test_the_rollout_engine_gets_the_layouts_tp_share_length_and_sleep_on_a_gpu() -> None:
    plan = dataclasses.replace(preset_layout("qwen3_14b"), rollout_memory_fraction=0.4)
    settings = ParallelDims(tp=4, dp=2, plan=plan).rollout_engine_settings("cuda")
    assert settings == {
        "tensor_parallel_size": 2,
        "max_model_len": 8192,
        "enable_sleep_mode": True,
        "gpu_memory_utilization": 0.4,
    }
    awake = dataclasses.replace(plan, rollout_sleep=False)
    assert ParallelDims(tp=4, dp=2, plan=awake).rollout_engine_settings("cuda")["enable_sleep_mode"] is False


def test_on_cpu_the_engine_gets_no_memory_share_and_never_sleeps() -> None:
    settings = ParallelDims(plan=preset_layout("tiny")).rollout_engine_settings("cpu")
    assert settings == {"tensor_parallel_size": 1, "max_model_len": 64, "enable_sleep_mode": False}


def test_the_dims_read_from_megatron_must_agree_with_the_plan(megatron: None) -> None:
    dims = ParallelDims.current(preset_layout("tiny"))
    assert (dims.tp, dims.pp, dims.dp, dims.tp_rank, dims.dp_rank) == (1, 1, 1, 0, 0) and not dims.model_split
    assert ParallelDims.current().plan.world_size == 1
    with pytest.raises(RuntimeError, match=r"TP x PP x DP = \(1, 1, 1\), the run's layout says \(2, 1, 1\)"):
        ParallelDims.current(ParallelLayout(tensor_parallel=2, gpus_per_node=2))
