"""benchmarks/gpu_bench.py on CPU: refuses without a GPU; its verdicts and report from given results."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from . import ROOT, load_benchmark


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_refuses_without_a_gpu(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_bench.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_verdicts_compare_ratios_with_the_issue_targets() -> None:
    bench = load_benchmark("gpu_bench")
    results = {
        "train_step": {"speedup": {"bf16": 1.0, "tensorwise": 1.42, "blockwise": 1.05}},
        "vllm": {"speedup_fp8": 1.25},
    }
    v = bench.verdicts(results)
    assert v["train_step tensorwise"] == {"ratio": 1.42, "target": 1.3, "met": True}
    assert v["train_step blockwise"]["met"] is False
    assert v["vllm decode fp8"]["met"] is True
    md = bench.markdown(results, v, {"git_sha": "0123456789abc", "git_dirty": "false"}, "NVIDIA H200 (9.0)")
    assert "| train_step blockwise | 1.05x | 1.1x | NO |" in md and "git 0123456789" in md


def test_sections_without_their_stack_are_reported_as_skipped() -> None:
    bench = load_benchmark("gpu_bench")
    assert bench.have("torch") is None
    assert bench.have("surely_not_a_module_xyz") == "not installed: surely_not_a_module_xyz"


def test_gpu_check_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")]).returncode == 0
