"""Suite-wide pytest setup: the `gpu` marker skips (with a reason) where no CUDA device exists; small,
fast run configs shared by the trainer and rollout tests (a short warm start cached once per session)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fp8rl.config import RunConfig


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none found); run benchmarks/gpu_check.sh on a GPU host")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """In the integration lane (FP8RL_REQUIRE_VLLM=1) a skipped vLLM test is a failure, not a pass."""
    outcome = yield
    report = outcome.get_result()
    in_vllm_lane = os.environ.get("FP8RL_REQUIRE_VLLM") == "1"
    if in_vllm_lane and report.skipped and "tests/rollout" in str(item.path).replace(os.sep, "/"):
        report.outcome = "failed"
        report.longrepr = f"vLLM test skipped in the integration lane (FP8RL_REQUIRE_VLLM=1): {report.longrepr}"


@pytest.fixture(scope="session")
def warmstart_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("warmstart")


@pytest.fixture
def small_cfg(warmstart_cache: Path, tmp_path: Path) -> RunConfig:
    """4 prompts x 4 samples, 2 mini-batches, 30-step warm start, no MLflow."""
    cfg = RunConfig()
    cfg.warmstart.steps = 30
    cfg.warmstart.batch_size = 64
    cfg.warmstart.cache_dir = str(warmstart_cache)
    cfg.task.num_eval = 32
    cfg.trainer.steps = 2
    cfg.trainer.eval_size = 16
    cfg.trainer.eval_every = 0
    cfg.trainer.checkpoint_every = 1
    cfg.trainer.out_dir = str(tmp_path / "run")
    cfg.algo.prompts_per_step = 4
    cfg.algo.group_size = 4
    cfg.algo.num_minibatches = 2
    cfg.tracking.enabled = False
    return cfg
