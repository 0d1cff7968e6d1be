"""Atomic, verified checkpoints of everything a resumed run needs to continue bit for bit on CPU.

Prompts and sampling noise are derived from (seed, step), so the step counter is the data position.

- A checkpoint is written to a temporary file, flushed to disk and renamed, with a sidecar
  ``step_NNNNNN.pt.sha256`` holding its size and SHA-256: a job killed mid-write leaves the previous
  checkpoint intact, and a truncated or altered file is detected before it is read.
- Files are read with ``torch.load(weights_only=True)``: tensors and plain containers only (the model,
  optimizer and RNG states are such), so a file dropped into the folder cannot run code.
- `latest_good_checkpoint` walks from the newest checkpoint back: a corrupt one is reported (naming the
  file and what is wrong), moved aside as ``*.corrupt`` (kept, never deleted) and the previous one is used.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)
CHECKPOINT_PATTERN = re.compile(r"step_(\d+)\.pt$")
_CHUNK = 1 << 22


class CorruptCheckpoint(RuntimeError):
    """A checkpoint file that fails its size or checksum check, or cannot be read."""


def checkpoint_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def save_checkpoint(out_dir: str | Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Write `state` as checkpoint `step` (the number of completed steps); keep the `keep` newest."""
    directory = checkpoint_dir(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:06d}.pt"
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    os.close(fd)
    try:
        torch.save(state, tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        _sidecar(path).write_text(f"{_digest(Path(tmp))} {os.path.getsize(tmp)}\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for old in list_checkpoints(out_dir)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
        _sidecar(old).unlink(missing_ok=True)
    return path


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Checkpoints in `out_dir`, oldest first."""
    directory = checkpoint_dir(out_dir)
    if not directory.exists():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := CHECKPOINT_PATTERN.search(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest checkpoint file, unverified (see `latest_good_checkpoint`)."""
    checkpoints = list_checkpoints(out_dir)
    return checkpoints[-1] if checkpoints else None


def verify_checkpoint(path: str | Path) -> None:
    """Raise CorruptCheckpoint when the file's size or SHA-256 differs from its sidecar (or it has none)."""
    path = Path(path)
    sidecar = _sidecar(path)
    if not sidecar.exists():
        raise CorruptCheckpoint(f"{path} has no {sidecar.name}: it was not written completely by fp8rl")
    expected_digest, expected_size = sidecar.read_text().split()
    size = path.stat().st_size
    if size != int(expected_size):
        raise CorruptCheckpoint(f"{path} has {size} bytes, {expected_size} were written: the file is truncated")
    if _digest(path) != expected_digest:
        raise CorruptCheckpoint(f"{path} does not match its SHA-256 in {sidecar.name}: the file was altered")


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Verify, then read a checkpoint (tensors and plain containers only)."""
    verify_checkpoint(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CorruptCheckpoint(f"{path} cannot be read safely: {err}") from err


def latest_good_checkpoint(out_dir: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """(path, state) of the newest checkpoint that verifies; corrupt newer ones are moved aside, with a
    message naming each. None when there is no checkpoint at all; CorruptCheckpoint when none is good."""
    checkpoints = list_checkpoints(out_dir)
    problems = []
    for path in reversed(checkpoints):
        try:
            return path, load_checkpoint(path)
        except CorruptCheckpoint as err:
            problems.append(str(err))
            aside = path.with_name(path.name + ".corrupt")
            os.replace(path, aside)
            log.error("%s; moved it to %s and trying the previous checkpoint", err, aside.name)
    if problems:
        raise CorruptCheckpoint(
            f"no good checkpoint in {checkpoint_dir(out_dir)}: "
            + "; ".join(problems)
            + ". Start fresh with trainer.resume=false (the files are kept as *.corrupt)"
        )
    return None
