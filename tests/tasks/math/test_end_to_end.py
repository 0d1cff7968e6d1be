"""The paper's pipeline end to end on CPU (`scale=mini`): data files in the published schemas -> the model's chat
template -> rollout -> math-verify reward -> update -> Avg@k / Pass@k on every benchmark -> MLflow, run as a user
runs it. The mini assets are the ones `make mini-assets` writes, made by the test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["dapo_math_17k", "deepscaler"])
def test_two_mini_steps_run_every_stage_and_log_avg_at_k(tmp_path: Path, mini_assets: dict[str, Path], dataset: str):
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "mini").symlink_to(mini_assets["model"].parent)  # where scale=mini looks
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    command = [sys.executable, "-m", "fp8rl.train", "scale=mini", f"task={dataset}", "trainer.steps=2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "MLFLOW_TRACKING_URI": uri}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    client = MlflowClient(uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED"
    metrics = run.data.metrics
    for benchmark in ("aime24", "aime25", "amc23", "math500"):
        assert f"eval/{benchmark}/avg_at_2" in metrics and f"eval/{benchmark}/pass_at_2" in metrics
    assert [m.step for m in client.get_metric_history(run.info.run_id, "rollout/reward")] == [1, 2]
    assert run.data.params["task.dataset"] == dataset and run.data.params["model.hf_path"] == ".cache/mini/model"
