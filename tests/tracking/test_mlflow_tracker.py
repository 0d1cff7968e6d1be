"""The one tracking layer: standard MLflow runs, a write-ahead log that survives a kill, a dead store refused
in seconds or trained through offline, NaN kept, credentials redacted."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.tracking import MlflowClient

from fp8rl.tracking import MlflowTracker, RunSpec, TrackingUnavailable, redact
from fp8rl.tracking.mlflow_tracker import CONFIG_HASH_TAG, WAL_NAME, metric_name, read_wal


def _spec(uri: str, **changes) -> RunSpec:
    base = {"tracking_uri": uri, "experiment": "unit", "run_name": "r", "system_metrics": False}
    return RunSpec(**{**base, **changes})


def _steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_a_run_is_a_standard_mlflow_run_with_description_params_and_metrics(tmp_path: Path, sqlite_uri: str) -> None:
    params = {"tracking.tracking_uri": "https://alice:s3cret@mlflow.example.org", "algo.lr": 1e-5}
    spec = _spec(sqlite_uri, params=params, description="**r**: the arm", tags={"algo": "grpo"})
    tracker = MlflowTracker(spec, tmp_path, connect_timeout_s=5, offline_ok=False)
    tracker.log_metrics({"rollout/reward": 0.5, "actor/loss": float("nan"), "x/inf": math.inf, "eval/a@1": 1.0}, 1)
    tracker.finish("FINISHED")
    run = MlflowClient(sqlite_uri).get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["mlflow.note.content"] == "**r**: the arm"
    assert run.data.tags["mlflow.user"] and run.data.tags["mlflow.source.type"]  # MLflow's standard tags
    assert run.data.params["tracking.tracking_uri"] == "https://***@mlflow.example.org"  # no credentials stored
    assert math.isnan(run.data.metrics["actor/loss"]) and run.data.metrics["x/inf"] > 1e300  # logged as such
    assert run.data.metrics["eval/a_1"] == 1.0  # a character MLflow refuses in names is replaced
    experiment = MlflowClient(sqlite_uri).get_experiment_by_name("unit")
    assert experiment.tags["mlflow.experimentKind"] == "finetuning"
    assert not (tmp_path / WAL_NAME).exists(), "every record confirmed: the write-ahead log is gone"


def test_a_killed_job_replays_its_log_and_every_step_lands_once(tmp_path: Path, sqlite_uri: str) -> None:
    first = MlflowTracker(_spec(sqlite_uri), tmp_path, connect_timeout_s=5, offline_ok=False)
    for step in (1, 2):
        first.log_metrics({"m": float(step)}, step)
    first._drain(30)
    # "killed": step 3 reached the log but never MLflow, and the run was never finished
    with open(tmp_path / WAL_NAME, "a") as fh:
        fh.write(json.dumps({"kind": "metrics", "step": 3, "timestamp": 0, "metrics": {"m": 3.0}}) + "\n")
        fh.write('{"kind": "metrics", "step": 4, "tim')  # torn by the kill mid-write
    resumed = MlflowTracker(_spec(sqlite_uri), tmp_path, connect_timeout_s=5, offline_ok=False)
    assert resumed.run_id == first.run_id  # the log names the run to continue
    resumed.log_metrics({"m": 4.0}, 4)
    resumed.finish()
    assert _steps(MlflowClient(sqlite_uri), first.run_id, "m") == [1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_offline_training_uploads_everything_when_a_late_server_starts(tmp_path: Path, monkeypatch) -> None:
    from fp8rl.tracking import mlflow_tracker
    from tests.support.services import MlflowServer, free_port

    monkeypatch.setattr(mlflow_tracker, "RETRY_EVERY_S", 0.0)
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    tracker = MlflowTracker(_spec(uri, params={"algo.lr": 1e-5}), tmp_path / "run", 3, offline_ok=True)
    assert tracker.run_id is None and not tracker.online
    for step in (1, 2):
        tracker.log_metrics({"m": float(step)}, step)
    assert [r["kind"] for r in read_wal(tmp_path / "run" / WAL_NAME)] == ["start", "metrics", "metrics"]
    with MlflowServer(tmp_path / "server", port=port):
        tracker.log_metrics({"m": 3.0}, 3)  # finds the server, creates the run, uploads the log
        assert tracker.online
        tracker.finish()
        client = MlflowClient(uri)
        run = client.get_run(tracker.run_id)
        assert run.info.status == "FINISHED" and run.data.params["algo.lr"] == "1e-05"
        assert _steps(client, tracker.run_id, "m") == [1, 2, 3]


def test_redaction_and_metric_names() -> None:
    assert redact("postgresql://u:p@db:5432/x and https://token@h") == "postgresql://***@db:5432/x and https://***@h"
    assert redact("sqlite:///mlflow.db") == "sqlite:///mlflow.db"
    assert metric_name("eval/aime24/avg@32") == "eval/aime24/avg_32"


# ------------------------------------------------------------------------------------ the record under faults
def _failing_uploads(monkeypatch: pytest.MonkeyPatch, steps: set[int]) -> None:
    """The uploads of `steps` fail once as a locked sqlite store fails them, while later steps' land."""
    original = MlflowClient.log_batch
    failed_once: set[int] = set()

    def log_batch(self, run_id, metrics=(), params=(), tags=(), synchronous=None, **kw):
        step = metrics[0].step if metrics else None
        if step in steps and step not in failed_once:
            failed_once.add(step)
            raise MlflowException("(sqlite3.OperationalError) database is locked")  # INTERNAL_ERROR
        return original(self, run_id, metrics=metrics, params=params, tags=tags, synchronous=synchronous, **kw)

    monkeypatch.setattr(MlflowClient, "log_batch", log_batch)


def test_steps_whose_upload_failed_are_sent_again_though_later_steps_landed(
    tmp_path: Path, sqlite_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28's locked store: steps 3-4 failed while 5-6 landed; MLflow's highest step said "all stored",
    the WAL was deleted and the run marked FINISHED without them."""
    from fp8rl.tracking import mlflow_tracker

    monkeypatch.setattr(mlflow_tracker, "RETRY_EVERY_S", 0.0)
    _failing_uploads(monkeypatch, {3, 4})
    tracker = MlflowTracker(_spec(sqlite_uri), tmp_path, connect_timeout_s=5, offline_ok=False)
    for step in range(1, 7):
        tracker.log_metrics({"m": float(step)}, step)
    tracker.finish()
    client = MlflowClient(sqlite_uri)
    assert _steps(client, tracker.run_id, "m") == [1, 2, 3, 4, 5, 6]
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    assert not (tmp_path / WAL_NAME).exists()


def test_a_request_the_store_refuses_is_told_by_its_error_code_and_dropped_while_the_run_goes_on(
    tmp_path: Path, sqlite_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow's error code, not its message, says a request was refused (retrying cannot help): the step stays in
    the WAL, the tracker stays online for the next steps, and the run is not marked FINISHED without it."""
    original = MlflowClient.log_batch

    def log_batch(self, run_id, metrics=(), params=(), tags=(), synchronous=None, **kw):
        if metrics and metrics[0].step == 2:
            raise MlflowException("the value was refused", error_code=INVALID_PARAMETER_VALUE)
        return original(self, run_id, metrics=metrics, params=params, tags=tags, synchronous=synchronous, **kw)

    monkeypatch.setattr(MlflowClient, "log_batch", log_batch)
    tracker = MlflowTracker(_spec(sqlite_uri), tmp_path, connect_timeout_s=5, offline_ok=False)
    for step in (1, 2, 3):
        tracker.log_metrics({"m": float(step)}, step)
        tracker._drain(5.0)
        assert tracker.online, step
    tracker.finish()
    client = MlflowClient(sqlite_uri)
    assert _steps(client, tracker.run_id, "m") == [1, 3]
    assert client.get_run(tracker.run_id).info.status == "FAILED"
    assert [r["step"] for r in read_wal(tmp_path / WAL_NAME) if r["kind"] == "metrics"] == [1, 2, 3]


def test_a_record_still_incomplete_at_the_end_is_not_finished_and_keeps_its_log(
    tmp_path: Path, sqlite_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fp8rl.tracking import mlflow_tracker

    monkeypatch.setattr(mlflow_tracker, "FINISH_WAIT_S", 0.5)
    tracker = MlflowTracker(_spec(sqlite_uri), tmp_path, connect_timeout_s=5, offline_ok=False)
    tracker.log_metrics({"m": 1.0}, 1)
    tracker._drain(30)
    monkeypatch.setattr(tracker, "_send", lambda record: None)  # step 2 never reaches the store
    tracker.log_metrics({"m": 2.0}, 2)
    tracker.finish()
    client = MlflowClient(sqlite_uri)
    assert client.get_run(tracker.run_id).info.status == "FAILED"  # not FINISHED, not left RUNNING
    records = read_wal(tmp_path / WAL_NAME)
    assert records[-1] == {"kind": "end", "status": "FINISHED"}  # what the sync marks once it has uploaded
    assert 2 in {r["step"] for r in records if r["kind"] == "metrics"}


def test_a_log_written_for_another_config_is_moved_aside_not_replayed(tmp_path: Path, sqlite_uri: str) -> None:
    """Issue 28: a crash before the first checkpoint, then the same run folder with another lr: the new
    metrics went into the old run."""
    old = MlflowTracker(_spec(sqlite_uri, tags={CONFIG_HASH_TAG: "aaaa"}), tmp_path, 5, offline_ok=False)
    old.log_metrics({"m": 1.0}, 1)
    old._drain(30)  # killed here: the log stays, the run stays RUNNING
    new = MlflowTracker(_spec(sqlite_uri, tags={CONFIG_HASH_TAG: "bbbb"}), tmp_path, 5, offline_ok=False)
    assert new.run_id != old.run_id
    new.log_metrics({"m": 10.0}, 1)
    new.finish()
    client = MlflowClient(sqlite_uri)
    assert [m.value for m in client.get_metric_history(old.run_id, "m")] == [1.0]
    assert [m.value for m in client.get_metric_history(new.run_id, "m")] == [10.0]
    assert len(list(tmp_path.glob("tracking_wal.*.foreign.jsonl"))) == 1


def test_a_log_naming_a_run_of_another_config_does_not_reopen_it(tmp_path: Path, sqlite_uri: str) -> None:
    client = MlflowClient(sqlite_uri)
    other = client.create_run(client.create_experiment("other"), tags={CONFIG_HASH_TAG: "cccc"}).info.run_id
    (tmp_path / WAL_NAME).write_text(json.dumps({"kind": "run", "run_id": other}) + "\n")  # planted or stale
    tracker = MlflowTracker(_spec(sqlite_uri, tags={CONFIG_HASH_TAG: "dddd"}), tmp_path, 5, offline_ok=False)
    assert tracker.run_id != other
    tracker.finish()
    assert client.get_run(other).info.status == "RUNNING" and not client.get_run(other).data.metrics


def test_a_log_naming_a_run_without_a_config_hash_does_not_reopen_it(tmp_path: Path, sqlite_uri: str) -> None:
    """A sweep's parent run, or any run fp8rl did not make, carries no config hash: a WAL naming it is not this
    run's either."""
    client = MlflowClient(sqlite_uri)
    parent = client.create_run(client.create_experiment("sweep"), tags={"fp8rl.sweep": "x"}).info.run_id
    (tmp_path / WAL_NAME).write_text(json.dumps({"kind": "run", "run_id": parent}) + "\n")
    tracker = MlflowTracker(_spec(sqlite_uri, tags={CONFIG_HASH_TAG: "dddd"}), tmp_path, 5, offline_ok=False)
    tracker.log_metrics({"m": 1.0}, step=0)
    tracker.finish()
    assert tracker.run_id != parent
    assert client.get_run(parent).info.status == "RUNNING" and not client.get_run(parent).data.metrics


def test_a_planted_start_record_uploads_no_file_outside_the_run_folder(tmp_path: Path, sqlite_uri: str) -> None:
    """`fp8rl.tracking.sync` creates a run from the WAL's start record, which names the spec's artifacts."""
    from fp8rl.tracking.mlflow_tracker import spec_from_record

    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "resolved_config.json").write_text("{}")
    planted = tmp_path / "secret.txt"
    planted.write_text("not the run's")
    artifacts = [[str(folder / "resolved_config.json"), None], [str(planted), None], ["/etc/passwd", None]]
    record = {"tracking_uri": "x", "experiment": "e", "run_name": "r", "artifacts": artifacts}
    tracker = MlflowTracker(spec_from_record(record, sqlite_uri), folder, 5, offline_ok=False)
    tracker.finish()
    names = {a.path for a in MlflowClient(sqlite_uri).list_artifacts(tracker.run_id)}
    assert names == {"resolved_config.json"}


def test_replay_uploads_only_files_inside_the_run_folder(tmp_path: Path, sqlite_uri: str) -> None:
    own = tmp_path / "run" / "notes.txt"
    own.parent.mkdir()
    own.write_text("ours")
    planted = tmp_path / "secret.txt"
    planted.write_text("not the run's")
    lines = [{"kind": "artifact", "path": str(p), "artifact_path": None} for p in (own, planted, Path("/etc/passwd"))]
    (own.parent / WAL_NAME).write_text("".join(json.dumps(line) + "\n" for line in lines))
    tracker = MlflowTracker(_spec(sqlite_uri), own.parent, 5, offline_ok=False)
    tracker.finish()
    names = {a.path for a in MlflowClient(sqlite_uri).list_artifacts(tracker.run_id)}
    assert names == {"notes.txt"}


def test_a_store_locked_at_start_is_a_clear_error_not_a_raw_database_error(tmp_path: Path, sqlite_uri: str) -> None:
    import sqlite3

    MlflowClient(sqlite_uri).search_experiments()  # the schema exists
    holder = sqlite3.connect(sqlite_uri.removeprefix("sqlite:///"))
    holder.execute("BEGIN EXCLUSIVE")  # a backup or another writer holds the file
    try:
        with pytest.raises(TrackingUnavailable, match="refused to open the run.*wait and re-run the same command"):
            MlflowTracker(_spec(sqlite_uri), tmp_path, connect_timeout_s=1, offline_ok=False)
    finally:
        holder.rollback()
        holder.close()


def test_a_store_locked_at_start_for_less_than_the_timeout_is_waited_for(tmp_path: Path, sqlite_uri: str) -> None:
    """A lock released within ``tracking.connect_timeout_s`` delays the start; the run then opens."""
    import sqlite3
    import threading

    MlflowClient(sqlite_uri).search_experiments()
    holder = sqlite3.connect(sqlite_uri.removeprefix("sqlite:///"), check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")
    release = threading.Timer(2.0, holder.rollback)
    release.start()
    try:
        tracker = MlflowTracker(_spec(sqlite_uri), tmp_path, connect_timeout_s=20, offline_ok=False)
        tracker.log_metrics({"m": 1.0}, 0)
        tracker.finish()
    finally:
        release.join()
        holder.close()
    assert _steps(MlflowClient(sqlite_uri), tracker.run_id, "m") == [0]


@pytest.mark.long
@pytest.mark.timeout(600)
def test_a_store_locked_for_40_s_mid_run_loses_no_step(tmp_path: Path, sqlite_uri: str, monkeypatch) -> None:
    """Issue 28's probe as it was run: another writer holds the sqlite file for 40 s while the run logs a step a
    second. Before: steps 3-12 never reached MLflow, the WAL was deleted and the run marked FINISHED."""
    import sqlite3
    import threading

    from fp8rl.tracking import mlflow_tracker

    monkeypatch.setattr(mlflow_tracker, "RETRY_EVERY_S", 1.0)
    tracker = MlflowTracker(_spec(sqlite_uri), tmp_path / "run", connect_timeout_s=5, offline_ok=False)

    def hold(seconds: float) -> None:
        holder = sqlite3.connect(sqlite_uri.removeprefix("sqlite:///"), timeout=30)
        holder.execute("BEGIN EXCLUSIVE")
        time.sleep(seconds)
        holder.rollback()
        holder.close()

    locker = threading.Thread(target=hold, args=(40.0,))
    for step in range(1, 61):
        if step == 3:
            locker.start()
            time.sleep(0.2)
        tracker.log_metrics({"m": float(step)}, step)
        time.sleep(1.0)
    locker.join()
    tracker.finish()
    client = MlflowClient(sqlite_uri)
    assert _steps(client, tracker.run_id, "m") == list(range(1, 61))
    assert client.get_run(tracker.run_id).info.status == "FINISHED" and not (tmp_path / "run" / WAL_NAME).exists()


def test_a_deleted_experiment_is_restored_for_a_new_run(tmp_path: Path, sqlite_uri: str) -> None:
    client = MlflowClient(sqlite_uri)
    client.delete_experiment(client.create_experiment("unit"))
    tracker = MlflowTracker(_spec(sqlite_uri), tmp_path, connect_timeout_s=5, offline_ok=False)
    tracker.finish()
    experiment = client.get_experiment_by_name("unit")
    assert experiment.lifecycle_stage == "active"
    assert client.get_run(tracker.run_id).info.experiment_id == experiment.experiment_id


def test_an_offline_runs_log_keeps_no_credentials(tmp_path: Path) -> None:
    """The WAL's start record (how `fp8rl.tracking.sync` creates the run later) redacts the store's URI wherever
    it appears: its own field, the params (``tracking.tracking_uri``), the tags and the description."""
    from tests.support.services import free_port

    uri = f"https://alice:s3cret@127.0.0.1:{free_port()}/x?token=t0k"
    spec = _spec(uri, params={"tracking.tracking_uri": uri}, tags={"store": uri}, description=f"logged to {uri}")
    tracker = MlflowTracker(spec, tmp_path, 2, offline_ok=True)
    tracker.log_metrics({"m": 1.0}, 0)
    text = (tmp_path / WAL_NAME).read_text()
    assert "s3cret" not in text and "t0k" not in text and "127.0.0.1" in text
