"""Suite-wide pytest setup: the `gpu` marker skips (with a reason) where no CUDA device exists."""

from __future__ import annotations

import os

import pytest
import torch


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
