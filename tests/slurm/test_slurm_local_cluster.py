"""Integration tests against the real local one-node Slurm cluster (slurm/local/up.sh).

Run with::

    bash slurm/local/up.sh && .venv/bin/python -m pytest tests/slurm -q -m "integration or not integration"

Every job gets a fresh submitit folder (tmp_path): job ids restart at 1 when the cluster state is
purged, and a reused folder would hand back an old job's result.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
import submitit
from submitit.core.utils import UncompletedJobError

from ._slurm_testlib import PROFILES_DIR, result_within

pytestmark = pytest.mark.integration

# Whether the job's interpreter could import this module depends on its cwd and sys.path: ship the
# functions and classes defined here by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


def add_on_slurm(a: int, b: int) -> tuple[int, str]:
    return a + b, os.environ["SLURM_JOB_ID"]


class StepCounter(submitit.helpers.Checkpointable):
    """Counts ``n_steps`` steps into ``workdir/steps.log``, resuming after the last recorded step.

    Each step is one ``write()`` of a short line with O_APPEND, so even a SIGKILL cannot leave half a
    step behind, and the progress is the file itself: a requeued run (from submitit's checkpoint or
    from the original pickle) continues where the previous one stopped.
    """

    def __call__(self, workdir: str, n_steps: int, step_s: float) -> int:
        work = Path(workdir)
        # time.monotonic() is comparable with the test process's: the local cluster runs jobs on this host.
        restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
        _append(work / "starts.log", f"{time.monotonic():.3f} restart_count={restarts}")
        steps = work / "steps.log"
        done = len(steps.read_text().splitlines()) if steps.exists() else 0
        for i in range(done, n_steps):
            time.sleep(step_s)
            _append(steps, str(i))
        return n_steps

    def checkpoint(self, workdir: str, n_steps: int, step_s: float) -> submitit.helpers.DelayedSubmission:
        _append(Path(workdir) / "checkpoints.log", f"{time.monotonic():.3f}")
        return super().checkpoint(workdir, n_steps, step_s)


def _append(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{line}\n".encode())
    finally:
        os.close(fd)


@pytest.mark.timeout(120)
def test_cluster_is_up(slurm_cluster: dict[str, str]) -> None:
    node, partition = slurm_cluster["node"], slurm_cluster["partition"]
    state = subprocess.check_output(["sinfo", "-h", "-p", partition, "-n", node, "-o", "%T"], text=True).split()
    assert state and state[0] in {"idle", "mixed", "allocated"}, state
    cmd = ["srun", "-p", partition, "-t", "1", "hostname", "-s"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == node, out
    # Accounting works: submitit learns job states from sacct.
    subprocess.run(["sacct", "-n", "-X", "-j", "1"], check=True, capture_output=True, timeout=30)


@pytest.mark.timeout(120)
def test_submitit_job_returns_result(slurm_cluster: dict[str, str], make_executor, tmp_path: Path) -> None:
    executor = make_executor(tmp_path, timeout_min=2)
    t0 = time.monotonic()
    job = executor.submit(add_on_slurm, 2, 3)
    value, job_id = result_within(job, 60)
    print(f"\n[slurm] submit-to-result: {time.monotonic() - t0:.2f}s (job {job.job_id})")
    assert value == 5
    assert job_id == job.job_id
    # The result came from the result pickle; accounting must agree (submitit relies on it otherwise).
    wait_until(lambda: job.watcher.get_state(job.job_id, mode="force") == "COMPLETED", 30, "sacct: COMPLETED")


@pytest.mark.timeout(120)
def test_job_starting_before_its_log_folder_exists(
    slurm_cluster: dict[str, str], make_executor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """submitit creates the job's folder (<folder>/<job id>/, where Slurm writes the job's stdout) only
    after sbatch has returned the job id. On this idle one-node cluster a job can start before that,
    and Slurm would fail it ("Could not open stdout file"). The cluster's Prolog waits for the folder:
    delay its creation on purpose and check that the job still succeeds."""
    move = submitit.core.utils.JobPaths.move_temporary_file

    def slow_move(self, *args, **kwargs):
        time.sleep(3)
        return move(self, *args, **kwargs)

    monkeypatch.setattr(submitit.core.utils.JobPaths, "move_temporary_file", slow_move)
    executor = make_executor(tmp_path, timeout_min=2)
    job = executor.submit(add_on_slurm, 1, 2)
    assert result_within(job, 60)[0] == 3


@pytest.mark.timeout(120)
def test_cancelled_job_raises_quickly(slurm_cluster: dict[str, str], make_executor, tmp_path: Path) -> None:
    executor = make_executor(tmp_path, timeout_min=5)
    job = executor.submit(time.sleep, 600)
    wait_until(lambda: job.watcher.get_state(job.job_id, mode="force") == "RUNNING", 30, "the job to run")
    t0 = time.monotonic()
    subprocess.run(["scancel", job.job_id], check=True)
    # submitit sees the CANCELLED state through sacct (without accounting it never would) ...
    wait_until(job.done, 15, "submitit to notice the cancellation", interval_s=0.5)
    t_done = time.monotonic() - t0
    assert job.state.startswith("CANCELLED"), job.state
    # ... and result() raises after its fixed 15 s grace for a slow file system to show the result
    # pickle (SlurmJob._results_timeout_s).
    with pytest.raises(UncompletedJobError, match="has not produced any output"):
        result_within(job, 30)
    print(f"\n[slurm] scancel-to-done(): {t_done:.2f}s, scancel-to-exception: {time.monotonic() - t0:.2f}s")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mechanism", ["submitit_interrupt_timeout", "scontrol_requeue"])
def test_checkpoint_requeue_resumes(
    slurm_cluster: dict[str, str], make_executor, tmp_path: Path, mechanism: str
) -> None:
    """A Checkpointable job interrupted mid-run is requeued, resumes, and records each step once.

    * submitit_interrupt_timeout: ``job._interrupt(timeout=True)`` sends SIGUSR2 (what Slurm sends
      ``signal_delay_s`` before the time limit); submitit calls ``checkpoint()``, runs
      ``scontrol requeue`` from inside the job and exits.
    * scontrol_requeue: Slurm requeues from outside (like preemption/node failure with --requeue);
      submitit ignores the SIGTERM, the job is SIGKILLed after KillWait and restarts from its pickle.
    """
    # Long enough after the interrupt (8.5 s) to outlast KillWait (5 s): with `scontrol requeue`, the
    # job ignores SIGTERM and would otherwise just finish before Slurm kills it.
    n_steps, step_s = 20, 0.5
    work = tmp_path / "work"
    work.mkdir()
    executor = make_executor(tmp_path / "submitit", timeout_min=5)
    job = executor.submit(StepCounter(), str(work), n_steps, step_s)
    steps = work / "steps.log"
    wait_until(lambda: steps.exists() and len(steps.read_text().splitlines()) >= 3, 60, "3 steps")

    t_interrupt = time.monotonic()
    if mechanism == "submitit_interrupt_timeout":
        job._interrupt(timeout=True)
    else:
        subprocess.run(["scontrol", "requeue", job.job_id], check=True)

    assert result_within(job, 90) == n_steps
    starts = (work / "starts.log").read_text().splitlines()
    restart_s = float(starts[-1].split()[0]) - t_interrupt
    print(f"\n[slurm] {mechanism}: interrupt-to-restart {restart_s:.1f}s, starts={starts}")
    assert steps.read_text().splitlines() == [str(i) for i in range(n_steps)], "each step exactly once"
    assert len(starts) == 2, starts
    assert starts[1].endswith("restart_count=1"), starts
    checkpoints = work / "checkpoints.log"
    n_checkpoints = len(checkpoints.read_text().splitlines()) if checkpoints.exists() else 0
    assert n_checkpoints == (1 if mechanism == "submitit_interrupt_timeout" else 0)


HYDRA_APP = """
import os

import hydra


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    with open(os.path.join(cfg.out_dir, f"x{cfg.x}.txt"), "w") as f:
        f.write(os.environ["SLURM_ARRAY_JOB_ID"] + "_" + os.environ["SLURM_ARRAY_TASK_ID"])


if __name__ == "__main__":
    main()
"""


@pytest.mark.timeout(120)
def test_hydra_multirun_with_local_profile(slurm_cluster: dict[str, str], tmp_path: Path) -> None:
    """slurm/profiles/local.yaml used as-is as a hydra/launcher config: a 2-job sweep runs on Slurm."""
    (tmp_path / "conf" / "hydra" / "launcher").mkdir(parents=True)
    shutil.copy(PROFILES_DIR / "local.yaml", tmp_path / "conf" / "hydra" / "launcher" / "slurm_local.yaml")
    (tmp_path / "conf" / "config.yaml").write_text("x: 0\nout_dir: ???\n")
    (tmp_path / "app.py").write_text(HYDRA_APP)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "app.py", "--multirun", "hydra/launcher=slurm_local", "x=1,2"]
    cmd += [f"out_dir={out}", f"hydra.sweep.dir={tmp_path / 'multirun'}", "hydra.launcher.timeout_min=2"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=100)
    print(f"\n[slurm] hydra 2-job sweep: {time.monotonic() - t0:.1f}s")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = {p.name: p.read_text() for p in out.iterdir()}
    assert sorted(written) == ["x1.txt", "x2.txt"], written
    # Hydra's sweep is one Slurm job array: same array job id, task ids 0 and 1.
    array_ids, task_ids = zip(*(v.split("_") for v in written.values()), strict=True)
    assert len(set(array_ids)) == 1 and sorted(task_ids) == ["0", "1"], written
