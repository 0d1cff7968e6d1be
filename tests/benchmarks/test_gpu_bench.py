"""benchmarks/gpu_bench.py on CPU: refuses without a GPU; its verdicts and report from given results; missing
stacks skip; the report is on disk after every section."""

from __future__ import annotations

import argparse
import importlib.util
import json
import signal
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
        "train_step": {"backend": "megatron TE spec", "speedup": {"bf16": 1.0, "tensorwise": 1.42, "blockwise": 1.05}},
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


def test_have_never_raises_for_a_missing_parent_package() -> None:
    """importlib.util.find_spec("megatron.core") raises where megatron is absent; have() reports it."""
    bench = load_benchmark("gpu_bench")
    assert bench.have("surely_not_a_pkg_xyz.core") == "not installed: surely_not_a_pkg_xyz.core"
    assert bench.have("torch", "surely_not_a_pkg_xyz") == "not installed: surely_not_a_pkg_xyz"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="checks the skip where vLLM is absent")
def test_sections_whose_stack_is_missing_are_skipped_with_the_reason() -> None:
    bench = load_benchmark("gpu_bench")
    runners = bench.section_runners(argparse.Namespace(repeats=1, layers=1, seq=8, micro=1))
    assert set(runners) == set(bench.SECTION_NAMES)
    assert runners["vllm"]() == {"skipped": "not installed: vllm"}
    assert runners["mismatch"]()["skipped"].startswith("not installed: vllm")


def test_the_report_is_written_after_every_section_and_keeps_failures(tmp_path: Path) -> None:
    bench = load_benchmark("gpu_bench")
    seen = []

    def second():
        seen.append(json.loads((tmp_path / "gpu_check.json").read_text()))  # written before this section ran
        raise RuntimeError("section two broke")

    runners = {"one": lambda: {"value": 1}, "two": second, "three": lambda: {"value": 3}}
    results = bench.run_sections(
        ["one", "two", "three"], runners, lambda r: bench.write_report(tmp_path, r, "test device", done=False)
    )
    assert list(seen[0]["results"]) == ["one"] and seen[0]["complete"] is False
    assert results["two"]["error"] == "RuntimeError: section two broke" and results["three"]["value"] == 3
    final = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(final["results"]) == ["one", "two", "three"] and "## two" in (tmp_path / "gpu_check.md").read_text()


def test_a_run_killed_by_its_timeout_keeps_the_finished_sections(tmp_path: Path) -> None:
    """gpu_check.sh's `timeout` sends SIGTERM: the process dies without cleanup; what finished is on disk."""
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(ROOT / "benchmarks")!r})
import gpu_bench as bench
from pathlib import Path
out = Path({str(tmp_path)!r})
runners = {{"done": lambda: {{"value": 1}}, "hangs": lambda: os.kill(os.getpid(), signal.SIGTERM)}}
bench.run_sections(["done", "hangs"], runners, lambda r: bench.write_report(out, r, "test device", done=False))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == -signal.SIGTERM
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["results"]["done"]["value"] == 1 and "hangs" not in report["results"]


def test_the_gemm_only_fallback_is_not_scored_against_the_training_step_targets() -> None:
    bench = load_benchmark("gpu_bench")
    gemms_only = "torch._scaled_mm fallback (GEMMs only, no TE)"
    fallback = {"train_step": {"backend": gemms_only, "speedup": {"tensorwise": 2.0}}}
    assert bench.verdicts(fallback) == {}
    te = {"train_step": {"backend": "megatron TE spec", "speedup": {"tensorwise": 1.4, "blockwise": 1.0}}}
    assert set(bench.verdicts(te)) == {"train_step tensorwise", "train_step blockwise"}


def test_the_mismatch_section_builds_a_valid_run_config(tmp_path: Path) -> None:
    """Its config is built by overrides (the sections are frozen dataclasses) and passes the job's checks."""
    bench = load_benchmark("gpu_bench")
    cfg = bench.mismatch_config(str(tmp_path))
    assert (cfg.model.device, cfg.rollout.engine, cfg.precision.backend) == ("cuda", "vllm", "te")
