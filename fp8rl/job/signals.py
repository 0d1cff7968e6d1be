"""How a job learns that it is being stopped: SIGTERM/SIGINT, or a Slurm preemption that submitit requeues.

- Outside submitit, SIGTERM (``kill``, a scheduler's stop) raises `Terminated` in the main thread, so the
  job's clean-up marks the MLflow run KILLED instead of leaving it RUNNING. submitit's own handlers (it
  bypasses SIGTERM and checkpoints on its preemption signal) are left alone.
- submitit calls the job's ``checkpoint()`` before requeueing it and then exits with SystemExit; the
  job marks that here (`mark_requeued`), so the run is left SCHEDULED ("will resume"), not KILLED.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_requeued = threading.Event()


class Terminated(SystemExit):
    """The process received SIGTERM."""


def mark_requeued() -> None:
    _requeued.set()


def requeue_requested() -> bool:
    return _requeued.is_set()


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(128 + signum)


@contextmanager
def terminate_as_exception() -> Iterator[None]:
    """Inside the block, SIGTERM raises `Terminated` (where SIGTERM still has its default action)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
