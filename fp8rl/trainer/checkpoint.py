"""Atomic checkpoints of everything a resumed run needs to continue bit-for-bit on CPU.

Prompts and sampling noise are derived from (seed, step), so the step counter is the data position.
A checkpoint is written to a temporary file and renamed: a job killed mid-write leaves the previous
checkpoint intact.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_PATTERN = re.compile(r"step_(\d+)\.pt$")


def checkpoint_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def save_checkpoint(out_dir: str | Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Write `state` as checkpoint `step` (the number of completed steps); keep the `keep` newest."""
    directory = checkpoint_dir(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:06d}.pt"
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    os.close(fd)
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for old in list_checkpoints(out_dir)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return path


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Checkpoints in `out_dir`, oldest first."""
    directory = checkpoint_dir(out_dir)
    if not directory.exists():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := CHECKPOINT_PATTERN.search(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    checkpoints = list_checkpoints(out_dir)
    return checkpoints[-1] if checkpoints else None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)
