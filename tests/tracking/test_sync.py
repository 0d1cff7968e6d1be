"""`python -m fp8rl.tracking.sync`: a run that ended while MLflow was unreachable is uploaded later, once."""

from __future__ import annotations

from pathlib import Path

from mlflow.tracking import MlflowClient

from fp8rl.tracking import MlflowTracker, RunSpec
from fp8rl.tracking.mlflow_tracker import WAL_NAME
from fp8rl.tracking.sync import main, sync
from tests.support.services import free_port


def offline_run(folder: Path) -> None:
    """A run whose store never answered: 3 steps and its end, all in the write-ahead log."""
    spec = RunSpec(
        tracking_uri=f"http://127.0.0.1:{free_port()}",
        experiment="late",
        run_name="offline-run",
        params={"algo.lr": 1e-5},
        tags={"sweep": "s1"},
        description="trained while the server was down",
        system_metrics=False,
    )
    tracker = MlflowTracker(spec, folder, connect_timeout_s=2, offline_ok=True)
    for step in (1, 2, 3):
        tracker.log_metrics({"rollout/reward": step / 10, "eval/accuracy": float("nan")}, step)
    tracker.finish("FINISHED")


def test_an_offline_run_is_uploaded_with_its_description_and_status(tmp_path: Path, sqlite_uri: str) -> None:
    offline_run(tmp_path / "run")
    run_id = sync(tmp_path / "run", sqlite_uri)
    client = MlflowClient(sqlite_uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "offline-run"
    assert run.data.params["algo.lr"] == "1e-05" and run.data.tags["sweep"] == "s1"
    assert run.data.tags["mlflow.note.content"] == "trained while the server was down"
    assert [m.step for m in client.get_metric_history(run_id, "rollout/reward")] == [1, 2, 3]
    assert not (tmp_path / "run" / WAL_NAME).exists()  # everything stored: the log is gone


def test_the_command_line_says_what_is_wrong(tmp_path: Path, sqlite_uri: str, capsys) -> None:
    offline_run(tmp_path / "run")
    assert main([str(tmp_path / "run"), "--tracking-uri", sqlite_uri]) == 0
    assert main([str(tmp_path / "run"), "--tracking-uri", sqlite_uri]) == 2  # nothing left: nothing logged twice
    assert "nothing to upload" in capsys.readouterr().err
    offline_run(tmp_path / "again")
    dead = f"http://127.0.0.1:{free_port()}"
    assert main([str(tmp_path / "again"), "--tracking-uri", dead]) == 1
    assert (tmp_path / "again" / WAL_NAME).exists()  # kept for the next try
