"""The sweep runner with MLflow (sqlite): nesting and tags, skipping finished runs, resuming unfinished ones.

The end-to-end test runs in this process (launcher "inline"); the same runner on the local Slurm
cluster is tested in test_slurm_sweep.py (integration lane).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from fp8rl.job.run import existing_runs
from fp8rl.launch import SweepRequest, run_sweep
from fp8rl.launch.experiment import expand_points
from fp8rl.launch.launchers import resolve_launcher
from fp8rl.launch.sweep import SweepReport, define, job_name, mark_existing, mark_in_flight, prepare
from fp8rl.tracking import store as mlflow_runs

from .conftest import tiny_overrides

POINTS = [["precision=bf16"], ["precision=fp8_full", "recipe=blockwise"]]


def _request(tmp_path: Path, tiny: list[str], uri: str, **kw) -> SweepRequest:
    return SweepRequest(
        points=POINTS,
        overrides=tiny,
        launcher="inline",
        name="unit-sweep",
        root=tmp_path / "runs",
        tracking_uri=uri,
        **kw,
    )


def _planned(req: SweepRequest, create: bool) -> SweepReport:
    """The runner's plan (configs with their parent run id), without submitting."""
    definition = define(req)
    planned = prepare(definition, req.name, resolve_launcher(req.launcher), req.tracking_uri, req.root)
    report = SweepReport(req.name, req.tracking_uri, req.launcher, planned)
    mark_existing(report, create=create, definition=definition)
    return report


def _steps(client, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_sweep_nests_tags_resumes_and_skips(tmp_path: Path, tiny: list[str], sqlite_uri: str) -> None:
    req = _request(tmp_path, tiny, sqlite_uri)
    dry = run_sweep(_request(tmp_path, tiny, sqlite_uri, dry_run=True))
    assert [r.status for r in dry.runs] == ["new", "new"] and not dry.submitted
    assert not Path(sqlite_uri.removeprefix("sqlite:///")).exists(), "a dry run creates nothing"

    # An interrupted run: point 1 stopped after its first step (checkpoint at step 1, MLflow run SCHEDULED).
    from fp8rl.job import run_job

    run_job(_planned(req, create=True).runs[1].cfg, stop_after=1)

    report = run_sweep(req)
    assert [r.status for r in report.runs] == ["new", "resume"]
    assert [r.error for r in report.runs] == [None, None]
    client = mlflow_runs.client(sqlite_uri)
    children = mlflow_runs.child_runs(client, report.experiment_id)
    assert len(children) == 2, "the resumed point continued its run instead of opening a second one"
    for child in children:
        assert child.info.status == "FINISHED"
        assert child.data.tags["mlflow.parentRunId"] == report.parent_run_id
        assert child.data.tags["fp8rl.sweep"] == "unit-sweep"
        assert _steps(client, child.info.run_id, "rollout/reward") == [1, 2], "each step logged exactly once"
        assert _steps(client, child.info.run_id, "eval/accuracy") == [0, 2]
    tags = {c.data.tags["sweep.precision"]: c.data.tags for c in children}
    assert tags["bf16"]["recipe"] == "none" and tags["fp8_full"]["sweep.recipe"] == "blockwise"
    fresh = next(c for c in children if c.data.tags["sweep.precision"] == "bf16")
    assert fresh.data.metrics["launch/submit_to_first_step_s"] > 0
    assert _steps(client, fresh.info.run_id, "time/tracking_log") == [1, 2]  # the previous log call's duration
    parent = client.get_run(report.parent_run_id)
    assert (parent.info.status, parent.data.tags["fp8rl.role"]) == ("FINISHED", "sweep")

    again = run_sweep(req)
    assert [r.status for r in again.runs] == ["finished", "finished"] and not again.submitted
    assert again.parent_run_id == report.parent_run_id


@pytest.mark.timeout(300)
def test_existing_runs_are_found_by_hash_under_the_parent(tmp_path: Path, sqlite_uri: str) -> None:
    definition = expand_points([["precision=bf16"]], ["scale=tiny"])
    req = SweepRequest(points=[["precision=bf16"]], scale="tiny", name="lookup", root=tmp_path, tracking_uri=sqlite_uri)
    report = SweepReport(
        "lookup", sqlite_uri, "local", prepare(definition, "lookup", resolve_launcher("local"), sqlite_uri, tmp_path)
    )
    mark_existing(report, create=True, definition=definition)
    cfg, digest = report.runs[0].cfg, report.runs[0].config_hash
    assert existing_runs(cfg, sqlite_uri, digest) == (None, None)
    client = mlflow_runs.client(sqlite_uri)
    tags = {mlflow_runs.HASH_TAG: digest, "mlflow.parentRunId": report.parent_run_id}
    killed = client.create_run(report.experiment_id, tags=tags).info.run_id
    client.set_terminated(killed, "KILLED")
    assert existing_runs(cfg, sqlite_uri, digest) == (None, killed)
    assert [r.status for r in run_sweep(SweepRequest(**{**req.__dict__, "dry_run": True})).runs] == ["resume"]
    client.set_terminated(killed, "FINISHED")
    assert existing_runs(cfg, sqlite_uri, digest) == (killed, None)
    client.create_run(report.experiment_id, tags={**tags, mlflow_runs.HASH_TAG: "other"})
    assert existing_runs(cfg, sqlite_uri, digest) == (killed, None)


def test_queued_or_running_slurm_jobs_are_not_submitted_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    definition = expand_points([["precision=bf16"], ["precision=fp8_full"]], ["scale=tiny"])
    report = SweepReport("s", "x", "slurm", prepare(definition, "s", resolve_launcher("local"), "x", tmp_path))
    names = [job_name("s", r.config_hash) for r in report.runs]
    live = f"{names[0]}|12|RUNNING\n{names[1]}|13|COMPLETED\n"
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/squeue")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=live, stderr=""))
    mark_in_flight(report)
    assert [r.status for r in report.runs] == ["in-flight", "new"]


def test_the_dry_run_names_each_paper_runs_model_data_evaluation_and_layout() -> None:
    from fp8rl.compose import compose_config
    from fp8rl.launch.sweep import workload

    cfg = compose_config(["experiment=dapo_table", "scale=paper", "+experiment/arm=bf16"])
    model, data, evaluation, layout = workload(cfg)
    assert model == "Qwen/Qwen3-14B-Base" and data == "dapo_math_17k (hub)"
    assert evaluation.startswith("aime24, aime25, amc23, math500;") and "32 samples" in evaluation
    assert "TP 4 x PP 1 x DP 2" in layout


class _FakeJob:
    """A submitit job that finishes after `polls` looks (or never), with a result or an exception."""

    def __init__(self, job_id: int, polls: int | None, outcome: object) -> None:
        self.job_id, self.polls, self.outcome = job_id, polls, outcome

    def done(self) -> bool:
        if self.polls is None:
            return False
        self.polls -= 1
        return self.polls < 0

    def result(self) -> object:
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome

    def results(self) -> list[object]:  # submitit: one result per task (the sweep reads task 0's)
        return [self.result()]


def _slurm_runs(tmp_path: Path, outcomes: list[tuple[int | None, object]], monkeypatch) -> list:
    from fp8rl.launch import sweep

    definition = expand_points([["precision=bf16"], ["precision=fp8_full"]], ["scale=tiny"])
    runs = prepare(definition, "s", resolve_launcher("local"), "x", tmp_path)
    jobs = iter(_FakeJob(i, polls, outcome) for i, (polls, outcome) in enumerate(outcomes, start=100))
    executor = type("Executor", (), {"submit": lambda self, fn: next(jobs)})()
    monkeypatch.setattr(sweep, "make_executor", lambda *a: executor)
    monkeypatch.setattr(sweep, "SLURM_POLL_S", 0.01)
    return runs


def test_slurm_jobs_are_collected_as_they_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fp8rl.launch.sweep import Progress, _submit_slurm

    runs = _slurm_runs(tmp_path, [(3, {"run_id": "a"}), (1, RuntimeError("diverged"))], monkeypatch)
    lines: list[str] = []
    progress = Progress(2, "s", echo=lambda line, flush=False: lines.append(line))
    _submit_slurm(runs, "s", resolve_launcher("local"), tmp_path, True, None, progress)
    assert runs[0].result == {"run_id": "a"} and runs[1].error == "RuntimeError: diverged"
    assert lines[0].startswith("[s 1/2] ") and "FAILED (RuntimeError: diverged)" in lines[0]  # the first to finish


def test_slurm_jobs_still_running_at_the_timeout_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fp8rl.launch.sweep import _submit_slurm

    runs = _slurm_runs(tmp_path, [(0, {"run_id": "a"}), (None, None)], monkeypatch)
    with pytest.raises(TimeoutError, match="jobs 101 still running"):
        _submit_slurm(runs, "s", resolve_launcher("local"), tmp_path, True, 0.2, None)
    assert runs[0].result == {"run_id": "a"}


# ---------------------------------------------------------------------------------------------
# Two launches of one sweep at once (issue 28): they share the points out. Before, the second launch started
# every point the first was running, and each such point failed with the run folder's refusal (RunFolderInUse).

HOLD = """
import sys, time
from fp8rl.job.lock import run_folder_lock
with run_folder_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def _hold(folder: str) -> subprocess.Popen:
    """Another launch's job holding the run folder `folder`."""
    import sys

    process = subprocess.Popen([sys.executable, "-c", HOLD, folder], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_point_another_launch_holds_is_left_to_it_not_failed(tmp_path: Path, warmstart_dir: Path, sqlite_uri: str):
    req = _request(tmp_path, tiny_overrides(warmstart_dir, steps=1), sqlite_uri)
    held = _planned(req, create=True).runs[0]
    other = _hold(held.cfg.trainer.out_dir)
    try:
        report = run_sweep(req)
    finally:
        other.kill()
        other.wait()
    assert [r.error for r in report.runs] == [None, None]
    assert [r.status for r in report.runs] == ["in-flight", "new"]
    assert f"pid {other.pid}" in report.runs[0].result["held_by"] and report.runs[0].job_id is None
    client = mlflow_runs.client(sqlite_uri)
    children = mlflow_runs.child_runs(client, report.experiment_id)
    assert [c.data.tags[mlflow_runs.HASH_TAG] for c in children] == [report.runs[1].config_hash], "ran once, here"
    assert client.get_run(report.parent_run_id).info.status == "RUNNING", "the other launch's point is not done"


def test_a_job_that_finds_its_folder_taken_reports_it_held(tmp_path: Path) -> None:
    """The race: another launch took the point between this launch's look and its job's start."""
    from fp8rl.config import RunConfig, to_dict, with_overrides
    from fp8rl.launch.train_job import TrainJob

    cfg = with_overrides(RunConfig(), {"trainer.out_dir": str(tmp_path / "run"), "tracking.enabled": False})
    other = _hold(cfg.trainer.out_dir)
    try:
        result = TrainJob(to_dict(cfg))()
    finally:
        other.kill()
        other.wait()
    assert f"in use by pid {other.pid}" in result["held_by"]


def test_the_launch_that_ends_last_closes_the_parent(tmp_path: Path, sqlite_uri: str) -> None:
    """A point held by another launch while this one looked, FINISHED by the time this one ends: the parent run
    is FINISHED, not left RUNNING by both launches."""
    from fp8rl.launch.sweep import PlannedRun, _finish_parent

    definition = expand_points([["precision=bf16"], ["precision=fp8_full"]], ["scale=tiny"])
    planned = prepare(definition, "shared", resolve_launcher("local"), sqlite_uri, tmp_path)
    report = SweepReport("shared", sqlite_uri, "local", planned)
    mark_existing(report, create=True, definition=definition)
    client = mlflow_runs.client(sqlite_uri)
    for run in report.runs:  # point 0 ran in the other launch, point 1 here
        tags = {mlflow_runs.HASH_TAG: run.config_hash, "mlflow.parentRunId": report.parent_run_id}
        client.set_terminated(client.create_run(report.experiment_id, tags=tags).info.run_id, "FINISHED")
    first, second = report.runs
    PlannedRun.mark_held(first, "pid 1 on another host")
    second.take({"run_id": "r", "config_hash": second.config_hash})
    _finish_parent(report)
    assert first.status == "finished"
    assert client.get_run(report.parent_run_id).info.status == "FINISHED"


def test_a_sweep_on_a_fresh_clone_passes_preflight_without_a_warm_start_cache(tmp_path: Path, monkeypatch) -> None:
    """The sweep pins the default warmstart.cache_dir to an absolute path (jobs elsewhere share it); preflight took
    that for a chosen folder that does not exist, so every point of `make reproduce` on a fresh clone failed."""
    from fp8rl.preflight import PreflightError, check_environment

    monkeypatch.chdir(tmp_path)  # no .cache/ here
    definition = expand_points([["precision=bf16"]], ["scale=tiny"])
    (run,) = prepare(definition, "fresh", resolve_launcher("local"), "sqlite:///x.db", tmp_path)
    assert Path(run.cfg.warmstart.cache_dir).is_absolute() and not Path(run.cfg.warmstart.cache_dir).exists()
    check_environment(run.cfg)
    from fp8rl.config import with_overrides

    with pytest.raises(PreflightError, match="does not exist"):
        check_environment(with_overrides(run.cfg, {"warmstart.cache_dir": str(tmp_path / "typo")}))


def test_a_jobs_pickled_config_carries_no_credentials(monkeypatch) -> None:
    """submitit pickles each job's config into the sweep's folder: a credentialed tracking URI travels in the
    job's environment instead ($MLFLOW_TRACKING_URI), which the job resolves to the same store."""
    from fp8rl.config import RunConfig, with_overrides
    from fp8rl.launch.train_job import job_config
    from fp8rl.tracking import resolve_tracking_uri

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///unused.db")  # restored after the test: job_config sets it
    uri = "https://alice:s3cret@mlflow.example/x"
    job = job_config(with_overrides(RunConfig(), {"tracking.tracking_uri": uri}))
    assert "s3cret" not in repr(job) and job["tracking"]["tracking_uri"] is None
    assert resolve_tracking_uri(job["tracking"]["tracking_uri"]) == uri
    plain = job_config(with_overrides(RunConfig(), {"tracking.tracking_uri": "sqlite:///m.db"}))
    assert plain["tracking"]["tracking_uri"] == "sqlite:///m.db"


@pytest.mark.timeout(300)
def test_an_experiments_sweep_carries_the_files_header_as_its_description(tmp_path: Path, sqlite_uri: str) -> None:
    """The MLflow experiment and the sweep's parent run show what the experiment file says it runs."""
    from fp8rl.launch.experiment import expand_experiment, experiment_description

    definition = expand_experiment("grpo_granularity", "tiny", ["+experiment/arm=bf16,fp8_tensorwise"])
    planned = prepare(definition, "described", resolve_launcher("local"), sqlite_uri, tmp_path)
    report = SweepReport("described", sqlite_uri, "local", planned)
    mark_existing(report, create=True, definition=definition)
    client = mlflow_runs.client(sqlite_uri)
    header = experiment_description("grpo_granularity")
    assert header.startswith("Paper table: GRPO") and "@package" not in header
    for described in (client.get_experiment(report.experiment_id), client.get_run(report.parent_run_id).data):
        note = described.tags["mlflow.note.content"]
        assert note.startswith(header) and f"{len(report.runs)} points at scale tiny" in note


def test_the_sweep_table_shows_its_store_without_credentials() -> None:
    import io

    from rich.console import Console

    from fp8rl.launch.sweep import print_report

    report = SweepReport("s", "https://alice:s3cret@mlflow.example/x?token=t0k", "local", [])
    out = io.StringIO()
    print_report(report, Console(file=out, width=200))
    assert "mlflow.example" in out.getvalue() and "s3cret" not in out.getvalue() and "t0k" not in out.getvalue()


def test_a_jobs_error_is_pickled_without_the_credentials_it_quotes(monkeypatch) -> None:
    """submitit pickles what a job raised into the sweep's folder; an MLflow error names the URI it called."""
    import pickle

    import fp8rl.job
    from fp8rl.config import RunConfig, to_dict
    from fp8rl.launch.train_job import JobFailed, TrainJob

    def fails(cfg, **kwargs):
        raise ConnectionError("API request to https://alice:s3cret@mlflow.example/api failed")

    monkeypatch.setattr(fp8rl.job, "run_job", fails)
    with pytest.raises(JobFailed) as raised:
        TrainJob(to_dict(RunConfig()))()
    assert "ConnectionError" in str(raised.value) and "mlflow.example" in str(raised.value)
    assert b"s3cret" not in pickle.dumps(raised.value)

    def fails_plainly(cfg, **kwargs):
        raise ValueError("no credentials here")

    monkeypatch.setattr(fp8rl.job, "run_job", fails_plainly)
    with pytest.raises(ValueError, match="no credentials here"):  # the original error, untouched
        TrainJob(to_dict(RunConfig()))()
