"""fp8rl.tracking.provenance: git state, versions and machine of a run."""

from __future__ import annotations

import subprocess
from pathlib import Path

from fp8rl.tracking.provenance import git_info, provenance


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def test_outputs_under_results_do_not_make_the_code_dirty(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q")
    (tmp_path / "results").mkdir()
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "results" / "bench.json").write_text("{}\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    assert git_info(tmp_path)["git_dirty"] == "false"
    (tmp_path / "results" / "bench.json").write_text('{"new": 1}\n')
    assert git_info(tmp_path)["git_dirty"] == "false"
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_info(tmp_path)["git_dirty"] == "true"


def test_provenance_names_the_allocator_setting(monkeypatch) -> None:
    for key in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(key, raising=False)
    assert provenance()["machine.malloc"] == "default"
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "33554432")
    record = provenance()
    assert record["machine.malloc"] == "MALLOC_MMAP_THRESHOLD_=33554432"
    assert record["git_sha"] != ""


AMD_CPUINFO = """processor	: 0
vendor_id	: AuthenticAMD
model name	: AMD EPYC
flags		: fpu sse2 avx2 avx512f avx512_bf16 sha_ni
processor	: 1
vendor_id	: AuthenticAMD
"""


def test_provenance_names_the_cpu_and_the_flags_that_pick_its_kernels(monkeypatch) -> None:
    """Tiny results differed between CPU types and the runs could not say which CPU made them."""
    from fp8rl.tracking.provenance import cpu_info

    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    info = cpu_info(AMD_CPUINFO)
    assert info["cpu_vendor"] == "AuthenticAMD" and info["cpu_model"] == "AMD EPYC"
    assert info["cpu_flags"] == "avx2,avx512f,avx512_bf16"  # no AMX
    assert "MKL_CBWR=COMPATIBLE" in info["kernel_settings"]
    assert "machine.cpu_flags" in provenance() and "machine.torch_cpu_capability" in provenance()


def test_a_copied_tree_takes_its_commit_from_the_environment_where_set(tmp_path, monkeypatch) -> None:
    """A GPU host got this tree's files beside an older clone's .git, so git named the wrong commit."""
    from fp8rl.tracking.provenance import git_info

    own = git_info()["git_sha"]
    monkeypatch.setenv("FP8RL_GIT_SHA", "abc123")
    monkeypatch.setenv("FP8RL_GIT_DIRTY", "false")
    assert git_info(tmp_path) == {"git_sha": "abc123", "git_dirty": "false"}  # tmp_path: no repository
    assert git_info() == {"git_sha": "abc123", "git_dirty": "false"}  # and over the checkout's own git
    monkeypatch.delenv("FP8RL_GIT_SHA")
    assert git_info()["git_sha"] == own
