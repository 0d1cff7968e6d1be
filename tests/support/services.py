"""Local services for the tests and the launch benchmark: an MLflow tracking server on 127.0.0.1 and the
one-node Slurm cluster of ``slurm/local`` (started by its own ``up.sh``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType

REPO = Path(__file__).resolve().parents[2]
SLURM_UP = REPO / "slurm" / "local" / "up.sh"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MlflowServer:
    """``mlflow server`` on 127.0.0.1 with a sqlite store in `root`, for as long as the context lasts."""

    def __init__(self, root: Path, workers: int = 1, start_timeout_s: float = 300.0, port: int | None = None) -> None:
        self.root = Path(root)
        self.port = port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.workers = workers
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> MlflowServer:
        self.root.mkdir(parents=True, exist_ok=True)
        mlflow_bin = Path(sys.executable).with_name("mlflow")
        cmd = [
            str(mlflow_bin), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", str(self.workers),
            "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination", str(self.root / "artifacts"),
        ]  # fmt: skip
        log = open(self.root / "server.log", "w")  # the server writes it until it exits
        # No job-execution workers (a huey consumer with 5 threads): tracking is all this server does.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"mlflow server not healthy after {self.start_timeout_s:.0f}s; see {self.root}/server.log")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, 15)  # the server's own session: uvicorn and its workers
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(10)

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def slurm_ready() -> bool:
    """A controller answers and a node can take jobs."""
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
        states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    usable = {"idle", "mixed", "allocated", "completing"}
    return "is UP" in ping.stdout and any(s.strip() in usable for s in states.stdout.split())


def ensure_local_slurm(timeout_s: float = 300.0) -> str:
    """Use the running cluster, else start the local one-node cluster with up.sh (needs root)."""
    if slurm_ready():
        return "already up"
    proc = subprocess.run(
        ["bash", str(SLURM_UP)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s
    )
    if proc.returncode != 0:
        raise RuntimeError(f"slurm/local/up.sh failed (rc={proc.returncode}):\n{proc.stdout}")
    return proc.stdout
