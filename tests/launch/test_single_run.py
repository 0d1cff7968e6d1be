"""``python -m fp8rl.train experiment=X`` without ``-m``: a sweep's axes left unset would silently train only the
first point, so the run is refused with what to change (unless every swept axis is set on the command line)."""

from __future__ import annotations

import subprocess
import sys

from fp8rl.train import unswept_axes

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def test_unset_axes_of_a_single_run_are_named() -> None:
    params = {"+experiment/arm": "bf16,fp8_tensorwise", "trainer.seed": "0,1"}
    assert unswept_axes("RUN", params, ["experiment=x"]) == ["+experiment/arm", "trainer.seed"]
    assert unswept_axes("RUN", params, ["+experiment/arm=bf16", "trainer.seed=1"]) == []
    assert unswept_axes("MULTIRUN", params, []) == []
    assert unswept_axes("RUN", {}, []) == []


def test_an_experiment_without_multirun_exits_2_before_anything_runs(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fp8rl.train", "experiment=grpo_granularity", f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "this experiment sweeps +experiment/arm" in done.stderr and "add -m" in done.stderr
