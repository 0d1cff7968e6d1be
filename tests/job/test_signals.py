"""How a job is stopped (fp8rl.job.signals): SIGTERM as an exception, and the watchdog for a blocked main thread."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import ctypes, signal, sys, time
from pathlib import Path
from fp8rl.job import signals
marker = Path(sys.argv[1])
try:
    with signals.terminate_as_exception(on_stuck=lambda: marker.write_text("stuck"), grace_s=0.5):
        print("ready", flush=True)
        if sys.argv[2] == "blocked":  # inside a C call, as in a collective waiting for a dead rank
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # (or it would return early, with EINTR)
            ctypes.CDLL(None).sleep(60)
        time.sleep(60)
except signals.Terminated:
    marker.write_text("handled")
    raise
"""


@pytest.mark.parametrize(("main_thread", "expected"), [("blocked", "stuck"), ("responsive", "handled")])
def test_a_sigterm_the_main_thread_cannot_handle_still_ends_the_run(tmp_path: Path, main_thread: str, expected: str):
    """kill -9 of one rank left the MLflow run RUNNING: rank 0 sat in a gloo collective, its SIGTERM handler never
    ran, and torchrun SIGKILLed it. The watchdog ends the run itself when the main thread cannot; when the main
    thread can, the usual path (Terminated, the job's clean-up) runs and the watchdog stays out of it."""
    marker = tmp_path / "ended"
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(marker), main_thread], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(1.0)  # into the sleep
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 128 + signal.SIGTERM
    assert marker.read_text() == expected
