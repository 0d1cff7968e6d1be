"""Bad input is refused before anything heavy exists: exit status 2, a message that says what to change, no run
folder, no MLflow run, in seconds. Each probe is one a user typed (issue 16), run as the user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.services import free_port

PROBES = [
    (["precision=bf16", "clipping=calibrated"], "needs precision.mode=fp8_full"),
    (["algo.advantage=grpoo"], "algo.advantage='grpoo' is not valid"),
    (["algo.policy_loss=xyz"], "algo.policy_loss='xyz' is not valid"),
    (["algo.kl_type=k9"], "algo.kl_type='k9' is not valid"),
    (["task.name=nope"], "task.name='nope' is not valid"),
    (["algo.num_minibatches=0"], "algo.num_minibatches=0 must be >= 1"),
    (["algo.prompts_per_step=0"], "algo.prompts_per_step=0 must be >= 1"),
    (["model.preset=qwen9"], "model.preset='qwen9' is not valid"),
    (["warmstart.cache_dir=/no/such/folder"], "warmstart.cache_dir=/no/such/folder does not exist"),
    (["precision.amax_reduction=some"], "precision.amax_reduction='some' is not valid"),
    (["algo.prompts_per_step=6", "algo.num_minibatches=4"], "prompts_per_step"),
    (["precision=fp8_full", "recipe=rowwise", "precision.backend=te", "model.device=cuda"], "rowwise"),
]


def run_cli(tmp_path: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fp8rl.train", *overrides, f"trainer.out_dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(("overrides", "message"), PROBES)
def test_a_bad_config_exits_2_with_advice_before_building_anything(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    started = time.monotonic()
    proc = run_cli(tmp_path, *overrides)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "mlflow.db").exists()
    assert time.monotonic() - started < 60


def test_a_dead_tracking_server_is_refused_within_seconds_with_advice(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    proc = run_cli(tmp_path, "tracking.connect_timeout_s=3", env={"MLFLOW_TRACKING_URI": dead})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "tracking.offline=true" in proc.stderr  # the way to train anyway
    assert not list((tmp_path / "run").glob("checkpoints/*"))
