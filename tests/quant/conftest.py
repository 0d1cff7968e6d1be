"""Fixtures for the FP8 emulator tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    """Run each test on one intra-op thread, restoring the setting afterwards.

    These tests use small tensors; on a loaded 2-core machine OpenMP's hand-off between threads then
    costs ~100x the work itself (40 ms instead of 0.2 ms per quantize). Results do not depend on it:
    amax reductions are exact, and the GEMM bounds hold for any accumulation order.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
