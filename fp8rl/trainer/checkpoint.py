"""Atomic, verified checkpoints of everything a resumed run needs to continue bit for bit on CPU.

Prompts and sampling noise are derived from (seed, step), so the step counter is the data position.

- A checkpoint is written to a temporary file, flushed to disk and renamed, with a sidecar
  ``step_NNNNNN.pt.sha256`` holding its size and SHA-256: a job killed mid-write leaves the previous
  checkpoint intact, and a truncated or altered file is detected before it is read.
- Files are read with ``torch.load(weights_only=True)``: tensors and plain containers only (the model,
  optimizer and RNG states are such), so a file dropped into the folder cannot run code.
- `latest_good_checkpoint` walks from the newest checkpoint back: a corrupt one is reported (naming the
  file and what is wrong), moved aside as ``*.corrupt`` (kept, never deleted) and the previous one is used.
- A job of several ranks writes one file per rank: ``step_NNNNNN.rankRRRRR.pt`` for ranks 1.., each rank's
  own state (its tensor/pipeline shard of the model, its optimizer shard), then rank 0's ``step_NNNNNN.pt``
  last, after a barrier: the step's checkpoint exists only once every rank's file is complete. It resumes on
  the same layout (``world_size`` is recorded in rank 0's file and checked).
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


class CheckpointLayoutMismatch(RuntimeError):
    """A good checkpoint written by a job with another number of ranks."""


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


def shard_path(path: Path, rank: int) -> Path:
    """Rank `rank`'s file of checkpoint `path` (rank 0's is `path` itself)."""
    return path if rank == 0 else path.with_name(path.name.replace(".pt", f".rank{rank:05d}.pt"))


def _write_atomically(path: Path, state: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
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


def save_checkpoint(
    out_dir: str | Path, step: int, state: dict[str, Any], keep: int = 2, rank: int = 0, world_size: int = 1
) -> Path:
    """Write `state` as checkpoint `step` (the number of completed steps); keep the `keep` newest.

    With several ranks every rank calls this with its own state; rank 0's file is written last."""
    import torch.distributed as dist

    directory = checkpoint_dir(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:06d}.pt"
    if rank > 0:
        _write_atomically(shard_path(path, rank), state)
    if world_size > 1:
        dist.barrier()
    if rank == 0:
        _write_atomically(path, {**state, "world_size": world_size})
        for old in list_checkpoints(out_dir)[:-keep] if keep > 0 else []:
            for r in range(_world_size_of(old)):
                shard_path(old, r).unlink(missing_ok=True)
                _sidecar(shard_path(old, r)).unlink(missing_ok=True)
    return path


def _world_size_of(path: Path) -> int:
    """How many rank files checkpoint `path` has (counted on disk, so a corrupt rank-0 file is no obstacle)."""
    return 1 + len(list(path.parent.glob(path.name.replace(".pt", ".rank*.pt"))))


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


def latest_good_checkpoint(out_dir: str | Path, world_size: int = 1) -> tuple[Path, dict[str, Any]] | None:
    """(path, rank 0's state) of the newest checkpoint that verifies (every rank's file, when it has several);
    corrupt newer ones are moved aside, with a message naming each. None when there is no checkpoint at all;
    CorruptCheckpoint when none is good."""
    checkpoints = list_checkpoints(out_dir)
    problems = []
    for path in reversed(checkpoints):
        try:
            for rank in range(1, _world_size_of(path)):
                verify_checkpoint(shard_path(path, rank))
            state = load_checkpoint(path)
        except CorruptCheckpoint as err:
            problems.append(str(err))
            aside = path.with_name(path.name + ".corrupt")
            os.replace(path, aside)
            log.error("%s; moved it to %s and trying the previous checkpoint", err, aside.name)
            continue
        saved_world = int(state.get("world_size", 1))
        if saved_world != world_size:
            raise CheckpointLayoutMismatch(
                f"{path} was written by {saved_world} rank(s), this job has {world_size}: resume with the "
                "layout it was saved with (same world size and parallel.* settings), or use trainer.resume=false"
            )
        return path, state
    if problems:
        raise CorruptCheckpoint(
            f"no good checkpoint in {checkpoint_dir(out_dir)}: "
            + "; ".join(problems)
            + ". Start fresh with trainer.resume=false (the files are kept as *.corrupt)"
        )
    return None
