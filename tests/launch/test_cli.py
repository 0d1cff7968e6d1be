"""The ``fp8rl`` command line (in-process): experiments, sweep --dry-run, config errors, compare."""

from __future__ import annotations

from pathlib import Path

import pytest

from fp8rl.cli import main

pytestmark = pytest.mark.timeout(300)


def test_experiments_lists_the_files(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["experiments"]) == 0
    out = capsys.readouterr().out
    assert "grpo_granularity" in out and "Paper table: GRPO" in out


def test_sweep_dry_run_prints_the_plan_and_submits_nothing(
    tmp_path: Path, sqlite_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sweep", "ablation_recal_interval", "--dry-run", "--root", str(tmp_path), "--tracking-uri", sqlite_uri]
    assert main([*argv, "trainer.seed=0,1"]) == 0  # an override after the options: a second axis
    out = capsys.readouterr().out
    assert "ablation_recal_interval-tiny" in out and "6 would submit" in out
    assert "python -m fp8rl.train experiment=ablation_recal_interval clipping.interval=40 trainer.seed=1" in out
    assert not list(tmp_path.iterdir()), "a dry run writes nothing"


def test_sweep_config_error_exits_2_with_advice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", "dapo_table", "--scale", "paper", "--dry-run", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "24 of 24 point(s) cannot run" in err and "--profile example_h100" in err


def test_unknown_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        main(["sweep", "dapo_table", "--bogus"])
    with pytest.raises(SystemExit):
        main(["experiments", "x=1"])


def test_compare_of_an_unknown_experiment(sqlite_uri: str) -> None:
    with pytest.raises(SystemExit, match="no MLflow store at"):
        main(["compare", "--experiment", "nope", "--tracking-uri", sqlite_uri])
    from fp8rl.tracking import store as runs

    runs.client(sqlite_uri).search_experiments()  # creates the store
    with pytest.raises(SystemExit, match="no MLflow experiment 'nope' in sqlite:///mlflow.db: run its sweep first"):
        main(["compare", "--experiment", "nope", "--tracking-uri", sqlite_uri])


def test_a_sweep_on_a_dead_tracking_server_is_refused_in_seconds_without_its_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The launcher's MLflow lookups are probed first (they hung 257 s in HTTP retries, then a raw traceback)."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = f"http://user:s3cret@127.0.0.1:{port}"
    started = time.monotonic()
    argv = ["sweep", "ablation_recal_interval", "--dry-run", "--root", str(tmp_path), "--tracking-uri", dead]
    assert main(argv) == 2
    assert time.monotonic() - started < 60
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "tracking.offline=true" in err and "s3cret" not in err


def test_one_command_lists_everything_a_user_runs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    commands = ("train", "demo", "sweep", "compare", "experiments", "report", "study", "docs", "sync", "ui-snapshot")
    for command in (*commands, "mini-assets"):
        assert f"    {command}" in out, command


def test_train_and_studies_hand_the_rest_of_the_line_to_their_module(monkeypatch: pytest.MonkeyPatch) -> None:
    import runpy
    import sys

    import fp8rl.studies.mechanism

    seen = {}
    monkeypatch.setattr(runpy, "run_module", lambda name, **kw: seen.update(train=[name, *sys.argv], **kw))
    monkeypatch.setattr(fp8rl.studies.mechanism, "main", lambda argv: seen.update(study=argv) or 3)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # restored after the test
    assert main(["train", "scale=tiny", "trainer.steps=2"]) == 0
    assert seen["train"] == ["fp8rl.train", "fp8rl train", "scale=tiny", "trainer.steps=2"]  # what Hydra reads
    assert seen["run_name"] == "__main__"  # Hydra finds sweeps/ from the script's file
    assert main(["study", "mechanism", "--lrs", "1e-6"]) == 3  # the study's exit status
    assert seen["study"] == ["--lrs", "1e-6"]


def test_sync_runs_the_wal_upload_with_its_own_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`fp8rl sync` is `python -m fp8rl.tracking.sync`, under the command's name."""
    with pytest.raises(SystemExit):
        main(["sync", "--help"])
    assert "usage: fp8rl sync" in capsys.readouterr().out


def test_docs_check_passes_on_the_committed_tables() -> None:
    assert main(["docs", "--check"]) == 0
