"""Suite-wide pytest setup: the `gpu` marker skips (with a reason) where no CUDA device exists; megatron's
process state for the tests that build models; small, fast run configs shared by the trainer and rollout
tests (a short warm start cached once per session)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fp8rl.config import RunConfig, with_overrides


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
def megatron() -> None:
    """megatron's process state (one rank, TP = PP = 1), as a job sets it up before building models."""
    from fp8rl.models.runtime import init_megatron

    init_megatron()


@pytest.fixture(scope="session")
def warmstart_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("warmstart")


SMALL = {  # 4 prompts x 4 samples, 2 mini-batches, 30-step warm start, no MLflow
    "warmstart.steps": 30,
    "warmstart.batch_size": 64,
    "task.num_eval": 32,
    "trainer.steps": 2,
    "eval.size": 16,
    "eval.every": 0,
    "trainer.checkpoint_every": 1,
    "algo.prompts_per_step": 4,
    "algo.group_size": 4,
    "algo.num_minibatches": 2,
    "tracking.enabled": False,
}


@pytest.fixture
def small_cfg(megatron: None, warmstart_cache: Path, tmp_path: Path) -> RunConfig:
    """`SMALL` with a shared warm-start cache and a run folder of the test's own."""
    places = {"warmstart.cache_dir": str(warmstart_cache), "trainer.out_dir": str(tmp_path / "run")}
    return with_overrides(RunConfig(), {**SMALL, **places})


@pytest.fixture
def sqlite_uri(tmp_path: Path) -> str:
    """A fresh sqlite MLflow store in the test's folder."""
    return f"sqlite:///{tmp_path / 'mlflow.db'}"
