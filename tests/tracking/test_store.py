"""fp8rl.tracking.store: a new sqlite store opened by several processes at once (issue 28)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

OPEN_AT_THE_SIGNAL = """
import sys, time
from pathlib import Path
from fp8rl.tracking import store
import mlflow.store.tracking.sqlalchemy_store  # imported before the signal: the calls below start together
go = Path(sys.argv[2])
while not go.exists():
    time.sleep(0.005)
client = store.client(sys.argv[1])
client.create_experiment(f"exp-{sys.argv[3]}")
print("ok", flush=True)
"""


@pytest.mark.timeout(300)
def test_processes_opening_a_new_sqlite_store_together_all_succeed(tmp_path: Path) -> None:
    """MLflow creates a sqlite store's tables on each process's first call; processes doing it at once on a new
    file failed (alembic's "expected to match one row ... in 'alembic_version'", a locked database): 4 of 4 pairs
    in a probe with mlflow 3.17.2. store.client creates them under a lock beside the store."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OPEN_AT_THE_SIGNAL, uri, str(go), str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    time.sleep(8)  # every process has imported mlflow and waits
    go.touch()
    outcomes = [proc.communicate(timeout=240) for proc in procs]
    for proc, (out, err) in zip(procs, outcomes, strict=True):
        assert proc.returncode == 0 and out.strip() == "ok", err[-1500:]
    from fp8rl.tracking import store

    names = {e.name for e in store.client(uri).search_experiments()}
    assert {"exp-0", "exp-1", "exp-2"} <= names
