"""fp8rl.tracking.client: a dead store refused in seconds, credentials redacted and sent as basic auth, the
experiment shared by jobs that create, tag or restore it at once, a sqlite store's artifacts beside it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from fp8rl.tracking import TrackingUnavailable, probe_store, redact


def test_a_dead_store_is_refused_within_seconds_with_advice() -> None:
    from tests.support.services import free_port

    started = time.monotonic()
    with pytest.raises(TrackingUnavailable, match="tracking.offline=true"):
        probe_store(f"http://127.0.0.1:{free_port()}", timeout_s=3)
    assert time.monotonic() - started < 10
    with pytest.raises(TrackingUnavailable, match="does not exist"):
        probe_store("sqlite:////no/such/folder/mlflow.db", timeout_s=1)


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
    from fp8rl.tracking.client import ensure_experiment, ensure_experiment_tag

    racing = _LosesTheRace(sqlite_uri)
    exp_id = ensure_experiment(racing, "unit")
    assert exp_id == MlflowClient(sqlite_uri).get_experiment_by_name("unit").experiment_id
    ensure_experiment_tag(racing, exp_id, "mlflow.experimentKind", "finetuning")
    assert MlflowClient(sqlite_uri).get_experiment(exp_id).tags["mlflow.experimentKind"] == "finetuning"


def test_a_collision_that_leaves_another_tag_value_is_raised(sqlite_uri: str) -> None:
    from mlflow.exceptions import MlflowException

    from fp8rl.tracking.client import ensure_experiment, ensure_experiment_tag

    racing = _LosesTheRace(sqlite_uri, other_value="genai")
    exp_id = ensure_experiment(racing, "unit")
    with pytest.raises(MlflowException, match="UNIQUE constraint"):
        ensure_experiment_tag(racing, exp_id, "mlflow.experimentKind", "finetuning")


def test_a_tag_already_in_place_is_not_written_again(sqlite_uri: str) -> None:
    from fp8rl.tracking.client import ensure_experiment_tag

    real = MlflowClient(sqlite_uri)
    exp_id = real.create_experiment("unit")
    real.set_experiment_tag(exp_id, "mlflow.experimentKind", "finetuning")
    racing = _LosesTheRace(sqlite_uri)  # any write would raise
    ensure_experiment_tag(racing, exp_id, "mlflow.experimentKind", "finetuning")


def test_a_job_that_loses_the_race_to_restore_the_experiment_takes_it(sqlite_uri: str) -> None:
    from mlflow.exceptions import MlflowException

    from fp8rl.tracking.client import ensure_experiment

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
    from fp8rl.tracking.client import ensure_experiment

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


def test_an_uncaught_errors_traceback_on_stderr_is_redacted() -> None:
    """What Python or Hydra prints for an uncaught MLflow error (its text names the URI it called)."""
    import subprocess
    import sys

    code = (
        "from fp8rl.tracking.client import redact_stderr\n"
        "redact_stderr()\n"
        "raise ConnectionError('API request to https://alice:s3cret@mlflow.example/api failed (?token=t0k)')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "mlflow.example" in proc.stderr
    assert "s3cret" not in proc.stderr and "t0k" not in proc.stderr
