"""Shared provenance and output helpers for the benchmarks (one JSON per run, beside a printed table)."""

from __future__ import annotations

import json
from pathlib import Path

from fp8rl.tracking.provenance import provenance


def write_json(path: str | Path | None, payload: dict) -> None:
    """Write `payload` plus provenance to `path` (if given)."""
    if not path:
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"provenance": provenance(), **payload}, indent=2, default=str) + "\n")
    print(f"wrote {out}")
