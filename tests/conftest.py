"""Suite-wide pytest setup: the `gpu` marker skips (with a reason) where no CUDA device exists."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none found); run benchmarks/gpu_check.sh on a GPU host")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
