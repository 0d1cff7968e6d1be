"""kill -9 of one rank of a two-rank job: the MLflow run is ended (not left RUNNING) and the log says it resumes."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import SMALL
from tests.golden.record import torchrun_command, torchrun_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def rank_pid(launcher: int, local_rank: int) -> int:
    """The pid of torchrun's worker with `local_rank` (read from its environment)."""
    children = subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True).stdout.split()
    for child in children:
        if f"LOCAL_RANK={local_rank}".encode() in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
            return int(child)
    raise AssertionError(f"no worker with LOCAL_RANK={local_rank} among {children}")


def test_a_rank_killed_mid_run_leaves_the_run_ended_and_resumable(tmp_path: Path, warmstart_cache: Path) -> None:
    """torchrun SIGTERMs rank 0 as soon as rank 1 dies; rank 0, already failing on the broken collective, died of
    that SIGTERM's default action in the middle of ending its run, which stayed RUNNING in MLflow."""
    settings = {**SMALL, "trainer.steps": 8, "trainer.threads": 1, "warmstart.cache_dir": str(warmstart_cache)}
    overrides = [f"{k}={v}" for k, v in settings.items() if k != "tracking.enabled"]
    command = [*torchrun_command(2), "-m", "fp8rl.train", *overrides]
    proc = subprocess.Popen(
        command, cwd=tmp_path, env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "step 2/8" in line:
            break
    os.kill(rank_pid(proc.pid, 1), signal.SIGKILL)
    rest, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, "".join(lines[-20:]) + rest[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert [r.info.status for r in runs] in (["FAILED"], ["KILLED"]), "".join(lines[-10:]) + rest[-3000:]
    logs = [path.read_text() for path in tmp_path.glob("outputs/runs/*/train.log")]
    assert any("re-running the same command resumes it" in text for text in logs)
