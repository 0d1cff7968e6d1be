"""One writer per run folder: a job holds `<run folder>/.run.lock` from before it writes anything there until it
ends, so a second launch of the same command (or the same sweep point twice) is refused at once with who holds
the folder, instead of training beside the first and logging every step twice into one run.

The lock is `filelock`'s (POSIX ``flock`` here): the kernel releases it when the holder dies, kill -9 included, so
a crashed run never leaves a stale lock. Who holds it (host, pid, start time, command) is written beside it for
the refusal's message.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import filelock

from fp8rl.config import ConfigError
from fp8rl.tracking.client import redact

LOCK_NAME = ".run.lock"
HOLDER_NAME = ".run.lock.holder.json"
LOCK_FILES = (LOCK_NAME, HOLDER_NAME)  # the lock's own files: not part of a run's content


class RunFolderInUse(ConfigError):
    """Another process holds the run folder (a config-time refusal: the launcher exits 2)."""


@contextlib.contextmanager
def run_folder_lock(out_dir: str | Path) -> Iterator[None]:
    """Hold the run folder `out_dir` for the duration; raises `RunFolderInUse` at once when another process does."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(folder / LOCK_NAME, timeout=0)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise RunFolderInUse(_refusal(folder)) from None
    holder = folder / HOLDER_NAME
    try:
        holder.write_text(json.dumps(_this_process()) + "\n")
        yield
    finally:
        holder.unlink(missing_ok=True)
        lock.release()


def held_by(out_dir: str | Path) -> str | None:
    """Who holds the run folder `out_dir` now (the refusal's words), or None when nobody does: a sweep asks before
    it starts a point, so two launches of one sweep share its points out instead of refusing each other's."""
    folder = Path(out_dir)
    if not (folder / LOCK_NAME).exists():
        return None  # never run, or no run has held it
    lock = filelock.FileLock(folder / LOCK_NAME, timeout=0)
    try:
        lock.acquire()
    except filelock.Timeout:
        return _refusal(folder)
    lock.release()
    return None


def _this_process() -> dict[str, str | int]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": redact(" ".join(sys.argv)),  # an override may carry a tracking URI's token
    }


def _refusal(folder: Path) -> str:
    try:
        holder = json.loads((folder / HOLDER_NAME).read_text())
        who = f"pid {holder['pid']} on {holder['host']} since {holder['since']} ({holder['command']})"
    except (OSError, ValueError, KeyError):
        who = "another process"
    return (
        f"run folder {folder} is in use by {who}: the same run is already running. Wait for it to end (this "
        "command then resumes or finds it finished), or give this run its own folder with trainer.out_dir=..."
    )
