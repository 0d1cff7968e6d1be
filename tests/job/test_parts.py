"""The job's parts built from the run config (fp8rl.job.parts)."""

from __future__ import annotations

import pytest

from fp8rl.config import RunConfig, flatten, to_dict, with_overrides
from fp8rl.job.parts import build_clip_policy
from fp8rl.report.frames import schedule_windows

CALIBRATED = {"precision.mode": "fp8_full", "clipping.policy": "calibrated", "clipping.interval": 5}


@pytest.mark.parametrize(("first_step", "first_calibration"), [(None, 5), (0, 0), (2, 2)])
def test_the_calibration_schedule_reaches_the_clip_policy(first_step: int | None, first_calibration: int) -> None:
    cfg = with_overrides(RunConfig(), {**CALIBRATED, "clipping.first_step": first_step, "clipping.init_low": 0.6})
    policy = build_clip_policy(cfg.algo, cfg.clipping)
    calibrating = [step for step in range(12) if policy.needs_calibration(step)]
    assert calibrating[0] == first_calibration
    assert policy.bounds.low == 0.6


@pytest.mark.parametrize("first_step", [None, 0, 3])
def test_the_tables_split_where_the_policy_first_calibrates(first_step: int | None) -> None:
    """The report's window (from the logged params) agrees with the policy: a calibration on step index f is
    logged at step f + 1 and in force from the next logged step."""
    cfg = with_overrides(RunConfig(), {**CALIBRATED, "clipping.first_step": first_step})
    policy = build_clip_policy(cfg.algo, cfg.clipping)
    first_calibration = min(step for step in range(50) if policy.needs_calibration(step))
    params = {key: str(value) for key, value in flatten(to_dict(cfg)).items()}
    assert schedule_windows(params)["mean_calibrated_bounds"][0] == first_calibration + 2


def test_the_vllm_engine_is_placed_where_the_layout_says(monkeypatch) -> None:
    """build_engine used to pass no rollout TP, memory share, length or sleep mode: vLLM ran TP 1 with its share
    resident during training whatever the layout said."""
    import dataclasses
    from types import SimpleNamespace

    from fp8rl.job import parts
    from fp8rl.models.dims import ParallelDims
    from fp8rl.models.parallel import preset_layout
    from fp8rl.rollout import vllm_engine

    seen = {}
    monkeypatch.setattr(vllm_engine, "VllmEngine", lambda *args, **kwargs: seen.update(kwargs))
    cfg = with_overrides(RunConfig(), {"rollout.engine": "vllm", "model.device": "cuda"})
    dims = ParallelDims(tp=4, dp=2, plan=dataclasses.replace(preset_layout("qwen3_14b"), rollout_memory_fraction=0.3))
    policy = SimpleNamespace(dims=dims)
    task = SimpleNamespace(tokenizer=SimpleNamespace(pad_id=0, save=None))
    plan = SimpleNamespace(rollout_recipe=None)
    parts.build_engine(cfg, policy, None, task, plan)
    assert (seen["tensor_parallel_size"], seen["max_model_len"]) == (2, 8192)
    assert (seen["gpu_memory_utilization"], seen["enable_sleep_mode"]) == (0.3, True)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [({}, None), ({"parallel.micro_batch_size": 2}, 2), ({"model.device": "cuda"}, 1)],
)
def test_passes_are_micro_batched_on_a_gpu_or_when_asked(overrides: dict, expected: int | None) -> None:
    """On a GPU a rank's whole batch was scored in one pass (qwen3_8b: ~159 GB of logits)."""
    from fp8rl.job.parts import micro_batch_size
    from fp8rl.models.parallel import preset_layout

    cfg = with_overrides(RunConfig(), overrides)
    assert micro_batch_size(cfg, preset_layout("tiny", micro_batch_size=cfg.parallel.micro_batch_size)) == expected
