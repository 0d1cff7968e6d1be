"""Keep freed buffers in the process (glibc malloc tuning for CPU runs).

With glibc's defaults, a freed buffer of more than a few MiB goes back to the operating system and
the next allocation of that size page-faults every 4 KiB page again. The FP8 emulator allocates
several activation-sized temporaries per GEMM (float32 copy, FP8 codes, widened operands), and on
this project's 2-core CPU those page faults can cost more than the arithmetic: quantizing a
(2048, 768) bf16 tensor in a loop took 7.5 ms with the defaults and 0.8-1.2 ms with freed memory kept.
Two `mallopt` settings keep freed memory for reuse: a fixed mmap threshold (32 MiB, glibc's 64-bit
maximum: smaller buffers come from the heap) and a 1 GiB trim threshold (the heap is not shrunk below
that). Peak memory is unchanged; memory freed after the peak stays with the process.

Off by default: once the emulator stopped allocating most of its temporaries, a whole RL step on the
tiny preset showed no difference beyond run-to-run and order effects (five paired `rl_step.py` runs:
with it, the step was slower in the four pairs where it ran first and faster in the one where it ran
second; the FP8 / BF16 ratio moved by 0.00-0.16 between the settings, in either direction). Turn it on
with ``trainer.keep_freed_memory=true`` (or `--malloc keep-freed` in the benchmarks) where a workload
allocates many short-lived large buffers. Speed only: results are bitwise the same either way; a no-op
where glibc's `mallopt` is missing (macOS, musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit glibc
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024

_state = "default"


def keep_freed_memory() -> bool:
    """Apply the two `mallopt` settings to this process; True when glibc accepted both (idempotent)."""
    global _state
    libc = _glibc()
    if libc is None:
        _state = "default (no glibc mallopt)"
        return False
    accepted = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    accepted = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and accepted
    _state = "keep-freed (mmap 32 MiB, trim 1 GiB)" if accepted else "default (mallopt refused)"
    return accepted


def malloc_state() -> str:
    """What this process's allocator runs with, for provenance."""
    return _state


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return None
    return libc
