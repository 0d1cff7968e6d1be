"""Integration lane: a 4-run tiny sweep on the local Slurm cluster through submitit, tracked by an MLflow server.

* the 4 runs finish, nested under the sweep's parent run, with their metrics;
* one job is requeued mid-run from outside (``scontrol requeue``, as preemption or a node failure
  would); it resumes from the trainer's checkpoint and finishes with every step logged exactly once;
* re-launching the same sweep submits nothing.

Run with ``make test-integration`` (or ``-m integration``); starts the cluster with slurm/local/up.sh
when root. Every run gets fresh folders (tmp_path): Slurm job ids restart at 1 after a purge.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fp8rl.launch import SweepRequest, run_sweep
from fp8rl.tracking import store as mlflow_runs
from tests.support.services import MlflowServer, ensure_local_slurm, slurm_ready

from .conftest import tiny_overrides

pytestmark = pytest.mark.integration
# The requeued job must outlive Slurm's KillWait (5 s) after the requeue even when steps take 0.3 s, else it
# finishes before the SIGKILL and only its (idempotent) rerun is exercised.
STEPS = 24


@pytest.fixture(scope="module")
def slurm(request: pytest.FixtureRequest) -> None:
    if not request.config.getoption("markexpr"):
        pytest.skip("integration test: select it with -m integration (starts the local Slurm cluster)")
    if shutil.which("sinfo") is None and os.geteuid() != 0:
        pytest.skip("no Slurm here and not root: run `sudo bash slurm/local/up.sh` first")
    if not slurm_ready():
        if os.geteuid() != 0:
            pytest.skip("no running Slurm cluster and not root: run `sudo bash slurm/local/up.sh` first")
        ensure_local_slurm()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory, slurm: None) -> Any:
    with MlflowServer(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


def _prewarm(req: SweepRequest) -> None:
    """Build the shared warm start once here, not in two concurrent jobs."""
    from fp8rl.config import with_overrides
    from fp8rl.job import build_trainer
    from fp8rl.launch.sweep import define

    cfg = define(req).points[0].cfg
    build_trainer(with_overrides(cfg, {"tracking.enabled": False}))


def _wait(predicate: Any, timeout_s: float, what: str, interval_s: float = 2.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def _running_child_past_step_1(client: Any, exp_id: str) -> Any:
    for run in mlflow_runs.child_runs(client, exp_id):
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "rollout/reward")]
        if run.info.status == "RUNNING" and steps and 1 <= max(steps) <= 2:
            return run
    return None


@pytest.mark.timeout(2400)
def test_sweep_on_slurm_requeue_resumes_and_relaunch_submits_nothing(
    mlflow_server: MlflowServer, tmp_path: Path, warmstart_dir: Path
) -> None:
    req = SweepRequest(
        experiment="fp8_rollout_baseline",
        overrides=[*tiny_overrides(warmstart_dir, steps=STEPS), "eval.every=6"],
        launcher="slurm",
        profile="local",
        launcher_overrides={"timeout_min": 30},
        name=f"it-{tmp_path.name}",
        root=tmp_path / "runs",
        tracking_uri=mlflow_server.uri,
        wait=True,
        timeout_s=2000,
    )
    _prewarm(req)
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(report=run_sweep(req)), daemon=True)
    thread.start()

    client = mlflow_runs.client(mlflow_server.uri)
    exp_id = _wait(lambda: client.get_experiment_by_name(req.name), 300, "the sweep's experiment").experiment_id
    victim = _wait(lambda: _running_child_past_step_1(client, exp_id), 1200, "a job past its first step", 1.0)
    digest = victim.data.tags[mlflow_runs.HASH_TAG]
    job_id = _slurm_job_of(digest)
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    t_requeue = time.monotonic()

    thread.join(2100)
    assert not thread.is_alive(), "the sweep did not finish"
    report = box["report"]
    took = time.monotonic() - t_requeue
    print(f"\n[slurm sweep] requeued job {job_id} (run {victim.info.run_id}); the rest took {took:.0f}s")
    assert [r.error for r in report.runs] == [None] * 4
    children = mlflow_runs.child_runs(client, exp_id)
    assert len(children) == 4 and {c.info.status for c in children} == {"FINISHED"}
    for child in children:
        assert child.data.tags["mlflow.parentRunId"] == report.parent_run_id
        rewards = [m.step for m in client.get_metric_history(child.info.run_id, "rollout/reward")]
        assert sorted(rewards) == list(range(1, STEPS + 1)), f"{child.info.run_name}: each step exactly once"
        assert {"eval/accuracy", "rollout/entropy", "time/step", "time/tracking_log"} <= set(child.data.metrics)
    assert "REQUEUED" in _sacct_states(job_id), "the job was requeued by Slurm"
    resumed = client.get_run(victim.info.run_id).data.tags
    assert resumed["fp8rl.slurm_restarts"] == "1" and int(resumed["fp8rl.resumed_from_step"]) >= 1, resumed
    assert client.get_run(report.parent_run_id).info.status == "FINISHED"

    again = run_sweep(req)
    assert not again.submitted and {r.status for r in again.runs} == {"finished"}
    # A job requeued just as it finished runs once more (and returns at once): let it go before teardown.
    _wait(lambda: not _jobs_named(req.name), 300, "the sweep's jobs to leave the queue")


def _jobs_named(sweep: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True, text=True, check=True).stdout
    return [name for name in out.split() if name.startswith(f"fp8rl-{sweep}-")]


def _slurm_job_of(digest: str) -> str:
    out = subprocess.run(["squeue", "-h", "-o", "%j %i"], capture_output=True, text=True, check=True).stdout
    ids = [line.split()[1] for line in out.splitlines() if line.split()[0].endswith(digest)]
    assert len(ids) == 1, out
    return ids[0]


def _sacct_states(job_id: str) -> str:
    cmd = ["sacct", "-j", job_id, "-D", "-X", "-n", "-o", "State"]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


@pytest.mark.timeout(1200)
def test_a_two_rank_cpu_job_on_slurm_trains_on_both_tasks_and_logs_one_run(
    mlflow_server: MlflowServer, tmp_path: Path, warmstart_dir: Path
) -> None:
    """One Slurm job of two tasks (``tasks_per_node=2``): two gloo ranks, one MLflow run, each step logged once,
    and the per-step log line in the job's output."""
    req = SweepRequest(
        points=[["precision=bf16"]],
        overrides=tiny_overrides(warmstart_dir, steps=3),
        launcher="slurm",
        profile="local",
        launcher_overrides={"timeout_min": 20, "tasks_per_node": 2, "cpus_per_task": 1},
        name=f"it2rank-{tmp_path.name}",
        root=tmp_path / "runs",
        tracking_uri=mlflow_server.uri,
        wait=True,
        timeout_s=1000,
    )
    _prewarm(req)
    report = run_sweep(req)
    assert [r.error for r in report.runs] == [None]
    client = mlflow_runs.client(mlflow_server.uri)
    exp_id = client.get_experiment_by_name(req.name).experiment_id
    (child,) = mlflow_runs.child_runs(client, exp_id)
    assert child.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(child.info.run_id, "rollout/reward")] == [1, 2, 3]
    outputs = list((tmp_path / "runs").rglob("*_0_log.out"))  # submitit: <job>_<task>_log.out, task 0
    assert outputs and any("step 3/3" in p.read_text() for p in outputs), outputs
    logs = "".join(p.read_text() for p in (tmp_path / "runs").rglob("*_1_log.*"))
    assert logs, "task 1 (rank 1) ran"
