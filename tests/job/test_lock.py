"""fp8rl.job.lock: one writer per run folder; the refusal names the holder; a dead holder leaves no lock."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fp8rl.job.lock import HOLDER_NAME, RunFolderInUse, run_folder_lock

HOLD = textwrap.dedent(
    """
    import sys, time
    from fp8rl.job.lock import run_folder_lock
    with run_folder_lock(sys.argv[1]):
        print("held", flush=True)
        time.sleep(600)
    """
)


def _holder(folder: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


def test_a_second_writer_is_refused_with_the_holder_and_a_way_out(tmp_path: Path) -> None:
    holder = _holder(tmp_path / "run")
    try:
        with pytest.raises(RunFolderInUse, match=rf"in use by pid {holder.pid} on .*trainer.out_dir"):
            with run_folder_lock(tmp_path / "run"):
                pass
    finally:
        holder.kill()
        holder.wait()


def test_a_killed_holder_leaves_the_folder_free(tmp_path: Path) -> None:
    holder = _holder(tmp_path / "run")
    holder.kill()  # SIGKILL: no finally block runs; the kernel drops the flock
    holder.wait()
    with run_folder_lock(tmp_path / "run"):
        assert (tmp_path / "run" / HOLDER_NAME).exists()
    assert not (tmp_path / "run" / HOLDER_NAME).exists()


def test_the_lock_is_released_when_the_run_raises(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        with run_folder_lock(tmp_path):
            raise RuntimeError("the run failed")
    with run_folder_lock(tmp_path):
        pass


def test_a_second_launch_of_the_same_run_is_refused_before_it_writes_anything(tmp_path: Path) -> None:
    from fp8rl.config import RunConfig, with_overrides
    from fp8rl.job import run_job

    folder = tmp_path / "run"
    cfg = with_overrides(RunConfig(), {"trainer.out_dir": str(folder), "tracking.enabled": False})
    holder = _holder(folder)
    try:
        with pytest.raises(RunFolderInUse, match="already running"):
            run_job(cfg)
        assert sorted(p.name for p in folder.iterdir()) == sorted([".run.lock", HOLDER_NAME])  # no train.log
    finally:
        holder.kill()
        holder.wait()


def test_a_fresh_start_keeps_the_lock_in_the_folder_and_moves_only_the_earlier_run(tmp_path: Path) -> None:
    """trainer.resume=false moves an earlier run aside: its files, not the lock this run holds (before, the lock
    moved with them and a second launch could enter the new, unlocked folder)."""
    from fp8rl.config import RunConfig, with_overrides
    from fp8rl.job.lock import LOCK_NAME, held_by
    from fp8rl.job.run import prepare_run_dir

    folder = tmp_path / "run"
    cfg = with_overrides(RunConfig(), {"trainer.out_dir": str(folder), "trainer.resume": False})
    with run_folder_lock(folder):
        assert prepare_run_dir(cfg, str(folder)) is None
        assert not list(tmp_path.glob("run.prev-*"))  # nothing but the lock: nothing to move aside
        (folder / "train.log").write_text("the earlier run")
        prepare_run_dir(cfg, str(folder))
        (aside,) = tmp_path.glob("run.prev-*")
        assert sorted(p.name for p in aside.iterdir()) == ["train.log"]
        assert sorted(p.name for p in folder.iterdir()) == sorted([LOCK_NAME, HOLDER_NAME])
        assert held_by(folder) is not None  # still this process's: a second launch is refused


def test_the_holder_file_keeps_no_credentials_from_the_command_line(tmp_path: Path, monkeypatch) -> None:
    argv = ["fp8rl", "train", "tracking.tracking_uri=https://alice:s3cret@mlflow.example/x?token=t0k"]
    monkeypatch.setattr(sys, "argv", argv)
    with run_folder_lock(tmp_path):
        text = (tmp_path / HOLDER_NAME).read_text()
    assert "s3cret" not in text and "t0k" not in text and "mlflow.example" in text
