"""benchmarks/gpu_bench.py on CPU: without a GPU it rehearses and its verdict is never a pass; the verdict and the
report from given results; missing stacks and spent budgets skip; the report is on disk after every section and
names no local path."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from . import ROOT, load_benchmark


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU rehearsal")
def test_without_a_gpu_the_check_rehearses_and_never_reads_as_a_pass(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_bench.py"), "--out", str(tmp_path), "--sections", "probe"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr  # EXIT_CODES["measured nothing on a GPU"]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["verdict"]["verdict"] == "measured nothing on a GPU" and report["complete"] is True
    assert report["results"]["probe"]["status"] == "rehearsed"
    text = (tmp_path / "gpu_check.md").read_text()
    assert "**Verdict: measured nothing on a GPU.**" in text and "| probe | rehearsed |" in text
    assert str(ROOT) not in text and str(ROOT) not in (tmp_path / "gpu_check.json").read_text()


def test_verdicts_compare_ratios_with_the_issue_targets() -> None:
    bench = load_benchmark("gpu_bench")
    results = {
        "te_train_step": {
            "backend": "megatron TE spec",
            "speedup": {"bf16": 1.0, "tensorwise": 1.42, "blockwise": 1.05},
        },
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


def test_sections_whose_stack_or_device_is_missing_are_skipped_with_the_reason(tmp_path: Path) -> None:
    bench = load_benchmark("gpu_bench")
    assert set(bench.SECTION_NAMES) >= {"probe", "quantizers", "gemm", "train_step", "rl", "vllm", "mismatch"}
    missing = bench.Section("x", lambda a, d: {}, 10, needs=("surely_not_a_module_xyz",))
    assert bench.precheck(missing) == "not installed: surely_not_a_module_xyz"
    if not torch.cuda.is_available():
        assert bench.precheck(bench.SECTIONS["vllm"]) == "needs a CUDA device (none found)"
        args = argparse.Namespace(repeats=1, layers=1, seq=8, micro=1, rl_steps=1)
        runners = bench.driver_runners(args, tmp_path, deadline=float("inf"))
        assert runners["mismatch"]() == {"skipped": "needs a CUDA device (none found)"}


def test_a_spent_budget_skips_the_remaining_sections(tmp_path: Path) -> None:
    bench = load_benchmark("gpu_bench")
    args = argparse.Namespace(repeats=1, layers=1, seq=8, micro=1, rl_steps=1)
    runners = bench.driver_runners(args, tmp_path, deadline=0.0)  # long past
    assert runners["gemm"]()["skipped"].startswith("the check's time budget was spent")


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


def test_only_the_te_training_step_is_scored_against_the_training_step_targets() -> None:
    bench = load_benchmark("gpu_bench")
    torchao = {"train_step": {"speedup_over_bf16": {"eager": {"tensorwise": 2.0}}}}
    assert bench.verdicts(torchao) == {}
    te = {"te_train_step": {"backend": "megatron TE spec", "speedup": {"tensorwise": 1.4, "blockwise": 1.0}}}
    assert set(bench.verdicts(te)) == {"train_step tensorwise", "train_step blockwise"}


def gpu(**extra):
    return {"device": "cuda", "checks": [{"what": "x", "ok": True}], **extra}


def test_a_report_of_only_skips_and_rehearsals_is_not_a_pass() -> None:
    bench = load_benchmark("gpu_bench")
    skips = {name: {"skipped": "no stack"} for name in bench.SECTION_NAMES}
    assert bench.verdict(skips)["verdict"] == "measured nothing on a GPU"
    rehearsal = {
        **skips,
        "probe": {"device": "cpu", "checks": [{"what": "x", "ok": True}]},
        "environment": {"device": "cuda", "info": True},
    }
    assert bench.status(rehearsal["probe"]) == "rehearsed" and bench.status(rehearsal["environment"]) == "info"
    assert bench.verdict(rehearsal)["verdict"] == "measured nothing on a GPU"
    assert bench.EXIT_CODES["measured nothing on a GPU"] != 0 and bench.verdict({})["verdict"] != "passed"


def test_verdict_failed_partial_and_passed() -> None:
    bench = load_benchmark("gpu_bench")
    required = {name: gpu() for name in bench.REQUIRED}
    assert bench.verdict(required)["verdict"] == "passed" and bench.EXIT_CODES["passed"] == 0
    optional_skipped = {**required, "vllm": {"skipped": "not installed: vllm"}}
    assert bench.verdict(optional_skipped)["verdict"] == "passed"
    one_required_skipped = {**required, "rl": {"skipped": "not installed: megatron.core"}}
    v = bench.verdict(one_required_skipped)
    assert v["verdict"] == "partial" and v["required_not_passed"] == ["rl"]
    a_check_did_not_hold = {**required, "gemm": gpu(checks=[{"what": "within bound", "ok": False}])}
    assert bench.status(a_check_did_not_hold["gemm"]) == "failed"
    assert bench.verdict(a_check_did_not_hold)["verdict"] == "failed"
    a_rehearsal_error = {"probe": {"error": "RuntimeError: boom"}, "gemm": {"device": "cpu", "checks": []}}
    assert bench.verdict(a_rehearsal_error)["verdict"] == "failed"


def test_the_report_names_no_local_path_and_states_the_verdict(tmp_path: Path) -> None:
    bench = load_benchmark("gpu_bench")
    results = {"probe": {"error": f"boom in {ROOT}/benchmarks/gpu_sections.py and {sys.prefix}/lib"}}
    bench.write_report(tmp_path, results, "test device", done=True)
    for name in ("gpu_check.json", "gpu_check.md"):
        text = (tmp_path / name).read_text()
        assert str(ROOT) not in text and sys.prefix not in text and "<repo>/benchmarks/gpu_sections.py" in text
    assert "**Verdict: failed.**" in (tmp_path / "gpu_check.md").read_text()


def test_junit_counts_and_skip_reasons(tmp_path: Path) -> None:
    bench = load_benchmark("gpu_bench")
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite tests="3" failures="0" errors="0" skipped="2">'
        '<testcase classname="a" name="t1"><skipped message="needs a CUDA GPU"/></testcase>'
        '<testcase classname="a" name="t2"><skipped message="needs a CUDA GPU"/></testcase>'
        '<testcase classname="a" name="t3"/></testsuite></testsuites>'
    )
    summary = bench.junit_summary(xml)
    assert (summary["passed"], summary["skipped_tests"], summary["skip_reasons"]) == (1, 2, ["needs a CUDA GPU"])
    assert "skipped" not in summary  # a result's "skipped" key is its skip reason, not a count


def test_a_child_past_its_timeout_is_killed() -> None:
    bench = load_benchmark("gpu_bench")
    t = time.perf_counter()
    assert bench.run_child([sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=1) == "timeout"
    assert time.perf_counter() - t < 30


def test_the_mismatch_section_builds_a_valid_run_config(tmp_path: Path) -> None:
    """Its config is built by overrides (the sections are frozen dataclasses) and passes the job's checks."""
    bench = load_benchmark("gpu_bench")
    cfg = bench.mismatch_config(str(tmp_path))
    assert (cfg.model.device, cfg.rollout.engine, cfg.precision.backend) == ("cuda", "vllm", "te")


def test_the_checks_logs_are_scrubbed_of_local_paths(tmp_path: Path) -> None:
    """The first H200 run's logs named the host's repository, bundle and output folders."""
    import tempfile

    gpu_bench = load_benchmark("gpu_bench")
    log = tmp_path / "gpu_tests.log"
    log.write_text(f"{gpu_bench.ROOT}/tests/x.py:1: skipped\n{tempfile.gettempdir()}/bundle/megatron/core.py:2\n")
    (tmp_path / "clean.log").write_text("nothing local\n")
    assert gpu_bench.scrub_files(tmp_path) == [log]
    text = log.read_text()
    assert str(gpu_bench.ROOT) not in text and tempfile.gettempdir() + "/" not in text
    assert text.startswith("<repo>/tests/x.py") and "<tmp>/bundle" in text
