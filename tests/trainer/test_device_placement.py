"""Device placement without a GPU: one RL step with the model on a fake accelerator ("fakegpu", tests/support/
fake_device.py). A tensor the step leaves on CPU meets a fake-device tensor and raises, as a GPU run would
("Expected all tensors to be on the same device")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("_fake_device_worker.py")


def run_worker(tmp_path: Path, *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path), *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_step_runs_with_every_tensor_on_the_accelerator(tmp_path: Path) -> None:
    result = run_worker(tmp_path)
    assert result["ran"], result
    assert result["grad_devices"] == ["fakegpu"]


@pytest.mark.slow
def test_data_left_on_the_host_is_caught(tmp_path: Path) -> None:
    """The control: the step's batch stays on CPU (the trainer's device not set), which must fail."""
    result = run_worker(tmp_path, "cpu")
    assert not result["ran"] and result["error"] == "FakeTensorDeviceMismatchError", result


def test_a_warm_start_step_runs_on_the_accelerator(tmp_path: Path) -> None:
    """A GPU host builds the warm start's model on CUDA; its CPU batches used to meet it there and fail."""
    result = run_worker(tmp_path, "warmstart")
    assert result["ran"] and result["grad_devices"] == ["fakegpu"], result
