"""Hydra's own route: ``python -m fp8rl.train -m ... hydra/launcher=submitit_local|slurm_local`` runs the
points through hydra-submitit-launcher (no sweep bookkeeping: that is `fp8rl sweep`'s job)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.services import slurm_ready

from .conftest import tiny_overrides

REPO = Path(__file__).resolve().parents[2]


def _multirun(tmp_path: Path, warmstart_dir: Path, launcher: str, extra: list[str]) -> subprocess.CompletedProcess:
    overrides = [*tiny_overrides(warmstart_dir, steps=1), "tracking.enabled=false", "precision=fp8_rollout"]
    overrides.append("trainer.out_dir=${hydra:runtime.output_dir}")  # the run folders inside the sweep folder
    cmd = [sys.executable, "-m", "fp8rl.train", "-m", f"hydra/launcher={launcher}",
           f"hydra.sweep.dir={tmp_path / 'sweep'}", *overrides, *extra]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)


def _assert_ran(proc: subprocess.CompletedProcess, tmp_path: Path, points: int) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for index in range(points):
        assert (tmp_path / "sweep" / str(index) / "checkpoints" / "step_000001.pt").exists()
    assert list((tmp_path / "sweep" / ".submitit").iterdir()), "jobs went through submitit"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_multirun_through_submitit_local(tmp_path: Path, warmstart_dir: Path) -> None:
    _assert_ran(_multirun(tmp_path, warmstart_dir, "submitit_local", ["trainer.seed=0"]), tmp_path, 1)


@pytest.mark.integration
@pytest.mark.timeout(1500)
def test_multirun_through_a_slurm_profile(tmp_path: Path, warmstart_dir: Path, request: pytest.FixtureRequest) -> None:
    if not request.config.getoption("markexpr") or not slurm_ready():
        pytest.skip("needs the local Slurm cluster (make test-integration)")
    _assert_ran(_multirun(tmp_path, warmstart_dir, "slurm_local", ["trainer.seed=0,1"]), tmp_path, 2)
