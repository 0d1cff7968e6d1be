"""How a job learns that it is being stopped: SIGTERM/SIGINT, or a Slurm preemption that submitit requeues.

- Outside submitit, SIGTERM (``kill``, a scheduler's stop) raises `Terminated` in the main thread, so the
  job's clean-up marks the MLflow run KILLED instead of leaving it RUNNING. submitit's own handlers (it
  bypasses SIGTERM and checkpoints on its preemption signal) are left alone.
- A SIGTERM that arrives while the main thread is blocked inside a C call (a collective waiting for a rank that
  was killed) cannot run Python's handler until the call returns; torchrun SIGKILLs the rank 30 s later and the
  run stayed RUNNING. A watchdog thread, woken at once through ``signal.set_wakeup_fd``, gives the main thread a
  grace period and, if its handler still has not run, calls the job's ``on_stuck`` (mark the run KILLED) and
  exits the process with 128 + SIGTERM.
- submitit calls the job's ``checkpoint()`` before requeueing it and then exits with SystemExit; the
  job marks that here (`mark_requeued`), so the run is left SCHEDULED ("will resume"), not KILLED.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)
_requeued = threading.Event()
_handled = threading.Event()  # the main thread's SIGTERM handler ran
STUCK_GRACE_S = 5.0  # torchrun waits 30 s between its SIGTERM and SIGKILL


class Terminated(SystemExit):
    """The process received SIGTERM."""


def mark_requeued() -> None:
    _requeued.set()


def requeue_requested() -> bool:
    return _requeued.is_set()


def _raise_terminated(signum: int, frame: Any) -> None:
    _handled.set()
    raise Terminated(128 + signum)


class Stopping:
    """The handle `terminate_as_exception` yields: `defer` makes a later SIGTERM wait for the end of the block."""

    def __init__(self, active: bool) -> None:
        self.active, self.deferred = active, False

    def defer(self) -> None:
        """From here on (the job's clean-up: ending its MLflow run) SIGTERM is held and raised after the block.
        torchrun SIGTERMs every other rank as soon as one dies; rank 0, already failing, died of the signal's
        default action in the middle of ending its run, which stayed RUNNING."""
        if self.active:
            signal.signal(signal.SIGTERM, self._hold)

    def _hold(self, signum: int, frame: Any) -> None:
        _handled.set()
        self.deferred = True
        log.warning("SIGTERM during the clean-up: it ends the process once the run is ended")


@contextmanager
def terminate_as_exception(
    on_stuck: Callable[[], None] | None = None, grace_s: float = STUCK_GRACE_S
) -> Iterator[Stopping]:
    """Inside the block, SIGTERM raises `Terminated` (where SIGTERM still has its default action), or waits once
    `Stopping.defer` is called; with `on_stuck`, a watchdog runs it if the main thread has not handled the signal
    `grace_s` after it came."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield Stopping(active=False)
        return
    _handled.clear()
    signal.signal(signal.SIGTERM, _raise_terminated)
    watchdog = _Watchdog(on_stuck, grace_s) if on_stuck is not None else None
    stopping = Stopping(active=True)
    try:
        yield stopping
    finally:
        if watchdog is not None:
            watchdog.stop()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if stopping.deferred:  # the block ended normally (an exception in flight wins)
        raise Terminated(128 + signal.SIGTERM)


class _Watchdog:
    """Woken by the C-level signal handler's write to a wakeup fd, whatever the main thread is doing."""

    def __init__(self, on_stuck: Callable[[], None], grace_s: float) -> None:
        self.on_stuck, self.grace_s = on_stuck, grace_s
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        self.previous_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        self.thread = threading.Thread(target=self._watch, name="fp8rl-sigterm-watchdog", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while True:
            received = os.read(self.read_fd, 1)
            if not received or received[0] == 0:  # stop()
                return
            if received[0] == signal.SIGTERM and not _handled.wait(self.grace_s):
                log.error("SIGTERM while the main thread is blocked (a rank died?): ending the run KILLED")
                try:
                    self.on_stuck()
                finally:
                    os._exit(128 + signal.SIGTERM)

    def stop(self) -> None:
        signal.set_wakeup_fd(self.previous_fd)
        os.write(self.write_fd, b"\0")
        self.thread.join(timeout=1.0)
        os.close(self.read_fd)
        os.close(self.write_fd)
