"""Faults during a job end clean (issue 16): a run is never left RUNNING in MLflow, the same command resumes,
a corrupt checkpoint falls back to the previous good one, secrets stay on the host.

In-process jobs use `run_job` on a sqlite MLflow store; the signal tests run the training command itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from fp8rl.config import RunConfig, with_overrides
from fp8rl.job import run_job
from fp8rl.trainer import checkpoint as ckpt
from tests.conftest import SMALL

ROOT = Path(__file__).resolve().parents[2]


def tracked(cfg: RunConfig, uri: str, **changes) -> RunConfig:
    return with_overrides(cfg, {"tracking.enabled": True, "tracking.tracking_uri": uri, **changes})


def only_run(uri: str):
    client = MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return client, runs[0]


def test_a_failure_while_building_marks_the_run_failed(small_cfg: RunConfig, sqlite_uri: str, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("injected: the model could not be built")

    monkeypatch.setattr("fp8rl.job.run.build_parts", broken)
    with pytest.raises(RuntimeError, match="injected"):
        run_job(tracked(small_cfg, sqlite_uri))
    assert only_run(sqlite_uri)[1].info.status == "FAILED"


def test_a_preempted_job_that_will_be_requeued_stays_resumable(
    small_cfg: RunConfig, sqlite_uri: str, monkeypatch
) -> None:
    """submitit's checkpoint() marks the requeue, then exits: the run is SCHEDULED, not KILLED, and resumes."""
    from fp8rl.job import signals
    from fp8rl.trainer import fit as fit_module

    original = fit_module.RLTrainer.train_step

    def preempted(self, step):
        result = original(self, step)
        if step == 0:
            signals.mark_requeued()
            raise SystemExit(0)
        return result

    monkeypatch.setattr(fit_module.RLTrainer, "train_step", preempted)
    cfg = tracked(small_cfg, sqlite_uri)
    with pytest.raises(SystemExit):
        run_job(cfg)
    monkeypatch.setattr(signals, "_requeued", type(signals._requeued)())  # the requeued process starts afresh
    assert only_run(sqlite_uri)[1].info.status == "SCHEDULED"
    monkeypatch.setattr(fit_module.RLTrainer, "train_step", original)
    summary = run_job(cfg)
    client, run = only_run(sqlite_uri)
    assert run.info.status == "FINISHED" and summary.run_id == run.info.run_id
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "rollout/reward")) == [1, 2]


def test_a_truncated_latest_checkpoint_falls_back_to_the_previous_one(small_cfg: RunConfig, caplog) -> None:
    cfg = with_overrides(small_cfg, {"trainer.steps": 3})
    uninterrupted = run_job(with_overrides(cfg, {"trainer.out_dir": small_cfg.trainer.out_dir + "-full"}))
    run_job(cfg, stop_after=2)
    latest = ckpt.latest_checkpoint(cfg.trainer.out_dir)
    assert latest.name == "step_000002.pt"
    latest.write_bytes(latest.read_bytes()[:1000])  # a job killed mid-copy, a full disk
    resumed = run_job(cfg)
    assert "step_000002.pt has 1000 bytes" in caplog.text  # the message names the file and what is wrong
    assert (latest.parent / "step_000002.pt.corrupt").exists()  # kept, never deleted
    assert resumed.steps_done == 3
    last, again = uninterrupted.history[-1], resumed.history[-1]
    keys = [k for k in last if not k.startswith(("time/", "launch/"))]
    assert {k: again[k] for k in keys} == {k: last[k] for k in keys}


def test_a_file_dropped_into_the_checkpoint_folder_cannot_run_code(tmp_path: Path) -> None:
    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    directory = ckpt.checkpoint_dir(tmp_path)
    ckpt.save_checkpoint(tmp_path, 1, {"payload": Payload()})
    with pytest.raises(ckpt.CorruptCheckpoint, match="cannot be read safely"):
        ckpt.load_checkpoint(directory / "step_000001.pt")
    assert not (tmp_path / "pwned").exists()


def test_credentials_in_the_tracking_uri_never_reach_mlflow(small_cfg: RunConfig, tmp_path: Path) -> None:
    """A ``user:token@`` URI (given in the config, so in params, the resolved config and the command line) is
    stored redacted everywhere the run is described."""
    from fp8rl.job.run import run_artifacts

    secret_cfg = with_overrides(small_cfg, {"tracking.tracking_uri": "https://alice:s3cret-token@mlflow.example/x"})
    hydra_dir = tmp_path / "hydra_out"
    (hydra_dir / ".hydra").mkdir(parents=True)
    (hydra_dir / ".hydra" / "overrides.yaml").write_text("- tracking.tracking_uri=https://alice:s3cret-token@h/x\n")
    out = tmp_path / "out"
    out.mkdir()
    for path, _folder in run_artifacts(secret_cfg, str(out), hydra_dir):
        assert "s3cret" not in Path(path).read_text(), path


@pytest.mark.slow
def test_sigterm_marks_the_run_killed_and_the_same_command_resumes_it(tmp_path: Path, warmstart_cache: Path) -> None:
    """The user's command, killed by SIGTERM after its second step, then typed again: one MLflow run, KILLED in
    between, FINISHED after, every step logged once (the default run folder comes from the config hash)."""
    overrides = [f"{k}={v}" for k, v in {**SMALL, "trainer.steps": 6}.items() if k != "tracking.enabled"]
    command = [sys.executable, "-m", "fp8rl.train", *overrides, f"warmstart.cache_dir={warmstart_cache}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"  # the default store: ./mlflow.db in the working directory
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + 600
    for line in proc.stdout:
        lines.append(line)
        if "step 2/6" in line or time.monotonic() > deadline:  # step 1 is checkpointed by then
            break
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode != 0, "".join(lines[-20:])
    client, run = only_run(uri)
    assert run.info.status == "KILLED"
    again = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    client, resumed = only_run(uri)
    assert resumed.info.run_id == run.info.run_id and resumed.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "rollout/reward")) == list(range(1, 7))
    assert resumed.data.tags["fp8rl.resumed_from_step"] != "0"


@pytest.mark.slow
def test_ctrl_c_prints_one_line_and_leaves_the_run_resumable(tmp_path: Path, warmstart_cache: Path) -> None:
    """Ctrl-C printed a 60-line traceback."""
    overrides = [f"{k}={v}" for k, v in {**SMALL, "trainer.steps": 6}.items() if k != "tracking.enabled"]
    command = [sys.executable, "-m", "fp8rl.train", *overrides, f"warmstart.cache_dir={warmstart_cache}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if "step 1/6" in line:
            break
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "interrupted (Ctrl-C): the run is marked KILLED" in stderr
    assert only_run(f"sqlite:///{tmp_path / 'mlflow.db'}")[1].info.status == "KILLED"
