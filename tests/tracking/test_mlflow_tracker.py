"""The one tracking layer: standard MLflow runs, a write-ahead log that survives a kill, a dead store refused
in seconds or trained through offline, NaN kept, credentials redacted."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from fp8rl.tracking import MlflowTracker, RunSpec, TrackingUnavailable, probe_store, redact
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


def test_a_dead_store_is_refused_within_seconds_with_advice() -> None:
    from tests.support.services import free_port

    started = time.monotonic()
    with pytest.raises(TrackingUnavailable, match="tracking.offline=true"):
        probe_store(f"http://127.0.0.1:{free_port()}", timeout_s=3)
    assert time.monotonic() - started < 10
    with pytest.raises(TrackingUnavailable, match="does not exist"):
        probe_store("sqlite:////no/such/folder/mlflow.db", timeout_s=1)


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


class _LosesTheRace:
    """A client that, like a job of a sweep started at the same moment as another, finds the experiment
    missing and its tag unset, and then collides with the other job's write, as MLflow's SQL store does."""

    def __init__(self, uri: str, other_value: str = "finetuning") -> None:
        self.real, self.other_value, self.looked_up = MlflowClient(uri), other_value, False

    def __getattr__(self, name: str):
        return getattr(self.real, name)

    def get_experiment_by_name(self, name: str):
        if not self.looked_up:
            self.looked_up = True
            return None  # the other job creates it just after this lookup
        return self.real.get_experiment_by_name(name)

    def create_experiment(self, name: str, artifact_location: str | None = None) -> str:
        self.real.create_experiment(name, artifact_location)  # the other job's create ...
        return self.real.create_experiment(name, artifact_location)  # ... and ours: RESOURCE_ALREADY_EXISTS

    def set_experiment_tag(self, experiment_id: str, key: str, value: str) -> None:
        from mlflow.exceptions import MlflowException

        self.real.set_experiment_tag(experiment_id, key, self.other_value)  # the other job's write
        raise MlflowException("(sqlite3.IntegrityError) UNIQUE constraint failed: experiment_tags.key")


def test_jobs_that_create_and_tag_the_experiment_at_once_share_it(sqlite_uri: str) -> None:
    from fp8rl.tracking.mlflow_tracker import ensure_experiment, ensure_experiment_tag

    racing = _LosesTheRace(sqlite_uri)
    exp_id = ensure_experiment(racing, "unit")
    assert exp_id == MlflowClient(sqlite_uri).get_experiment_by_name("unit").experiment_id
    ensure_experiment_tag(racing, exp_id, "mlflow.experimentKind", "finetuning")
    assert MlflowClient(sqlite_uri).get_experiment(exp_id).tags["mlflow.experimentKind"] == "finetuning"


def test_a_collision_that_leaves_another_tag_value_is_raised(sqlite_uri: str) -> None:
    from mlflow.exceptions import MlflowException

    from fp8rl.tracking.mlflow_tracker import ensure_experiment, ensure_experiment_tag

    racing = _LosesTheRace(sqlite_uri, other_value="genai")
    exp_id = ensure_experiment(racing, "unit")
    with pytest.raises(MlflowException, match="UNIQUE constraint"):
        ensure_experiment_tag(racing, exp_id, "mlflow.experimentKind", "finetuning")


def test_a_tag_already_in_place_is_not_written_again(sqlite_uri: str) -> None:
    from fp8rl.tracking.mlflow_tracker import ensure_experiment_tag

    real = MlflowClient(sqlite_uri)
    exp_id = real.create_experiment("unit")
    real.set_experiment_tag(exp_id, "mlflow.experimentKind", "finetuning")
    racing = _LosesTheRace(sqlite_uri)  # any write would raise
    ensure_experiment_tag(racing, exp_id, "mlflow.experimentKind", "finetuning")


def test_a_deleted_experiment_is_restored_for_a_new_run(tmp_path: Path, sqlite_uri: str) -> None:
    client = MlflowClient(sqlite_uri)
    client.delete_experiment(client.create_experiment("unit"))
    tracker = MlflowTracker(_spec(sqlite_uri), tmp_path, connect_timeout_s=5, offline_ok=False)
    tracker.finish()
    experiment = client.get_experiment_by_name("unit")
    assert experiment.lifecycle_stage == "active"
    assert client.get_run(tracker.run_id).info.experiment_id == experiment.experiment_id


def test_a_job_that_loses_the_race_to_restore_the_experiment_takes_it(sqlite_uri: str) -> None:
    from mlflow.exceptions import MlflowException

    from fp8rl.tracking.mlflow_tracker import ensure_experiment

    real = MlflowClient(sqlite_uri)
    exp_id = real.create_experiment("unit")
    real.delete_experiment(exp_id)

    class RestoredByAnother(_LosesTheRace):
        def get_experiment_by_name(self, name: str):
            return self.real.get_experiment_by_name(name)

        def restore_experiment(self, experiment_id: str) -> None:
            self.real.restore_experiment(experiment_id)  # the other job's restore ...
            raise MlflowException("No Experiment with id=1 exists")  # ... and ours, of an active experiment

    assert ensure_experiment(RestoredByAnother(sqlite_uri), "unit") == exp_id
    assert ensure_experiment(RestoredByAnother(sqlite_uri), "absent", create=False) is None


def test_redaction_covers_at_signs_in_passwords_and_query_tokens() -> None:
    assert redact("https://user:p@ss@host:5000/x") == "https://***@host:5000/x"
    assert redact("see https://h/api?token=abc&x=1 and http://h/?Access_Token=z#f") == (
        "see https://h/api?token=***&x=1 and http://h/?Access_Token=***#f"
    )
    assert redact("https://h/x?page=2") == "https://h/x?page=2"


def test_the_store_probe_sends_a_uris_credentials_as_basic_auth() -> None:
    """MLflow accepts ``https://user:token@host``; the probe must too (urllib alone looks the userinfo up as DNS)."""
    import base64
    import http.server
    import threading

    expected = "Basic " + base64.b64encode(b"user:p@ss").decode()

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            ok = self.path == "/health" and self.headers.get("Authorization") == expected
            self.send_response(200 if ok else 401)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        probe_store(f"http://user:p%40ss@127.0.0.1:{port}", 5)
        with pytest.raises(TrackingUnavailable, match="answered 401") as refused:
            probe_store(f"http://user:wrong-token@127.0.0.1:{port}", 5)
        assert "wrong-token" not in str(refused.value)
    finally:
        server.shutdown()


def test_a_sqlite_stores_artifacts_stay_beside_it_whatever_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    from fp8rl.tracking.mlflow_tracker import ensure_experiment

    store = tmp_path / "store" / "mlflow.db"
    store.parent.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    client = MlflowClient(f"sqlite:///{store}")
    experiment = client.get_experiment(ensure_experiment(client, "a sweep/x"))
    assert experiment.artifact_location == (store.parent / "mlruns" / "a_sweep_x").as_uri()
    run = client.create_run(experiment.experiment_id)
    client.log_text(run.info.run_id, "hello", "note.txt")
    assert any((store.parent / "mlruns" / "a_sweep_x").rglob("note.txt")) and not (elsewhere / "mlruns").exists()


# ------------------------------------------------------------------------------------ the record under faults
def _failing_uploads(monkeypatch: pytest.MonkeyPatch, steps: set[int]) -> None:
    """The async uploads of `steps` fail as a locked sqlite store fails them, while later steps' land."""
    from concurrent.futures import Future

    from mlflow.utils.async_logging.run_operations import RunOperations

    original = MlflowClient.log_batch
    failed_once: set[int] = set()

    def log_batch(self, run_id, metrics=(), params=(), tags=(), synchronous=None, **kw):
        step = metrics[0].step if metrics else None
        if synchronous is False and step in steps and step not in failed_once:
            failed_once.add(step)
            future: Future = Future()
            future.set_exception(RuntimeError("(sqlite3.OperationalError) database is locked"))
            return RunOperations([future])
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
