"""The paper's pipeline at mini scale with the vLLM engine (integration lane, .venv-vllm): a Qwen3-architecture
Hugging Face checkpoint and its BPE tokenizer served by vLLM, math data, math-verify reward, Avg@k, MLflow."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from fp8rl.tasks.math import write_mini_assets

from ._vllm import VLLM_INTEGRATION

pytestmark = VLLM_INTEGRATION
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dataset", ["dapo_math_17k", "deepscaler"])
def test_two_mini_steps_with_vllm_rollout(tmp_path: Path, dataset: str) -> None:
    write_mini_assets(tmp_path / ".cache" / "mini", seed=0)  # where scale=mini looks
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    command = [sys.executable, "-m", "fp8rl.train", "scale=mini", f"task={dataset}", "rollout=vllm", "trainer.steps=2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "MLFLOW_TRACKING_URI": uri}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    client = MlflowClient(uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED" and run.data.params["rollout.engine"] == "vllm"
    assert "eval/math500/avg_at_2" in run.data.metrics
    assert [m.step for m in client.get_metric_history(run.info.run_id, "rollout/reward")] == [1, 2]
