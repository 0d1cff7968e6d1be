"""Upload what a run could not send to MLflow: ``python -m fp8rl.tracking.sync RUN_FOLDER [--tracking-uri URI]``.

A run that lost its store and ended before it came back keeps every record in ``RUN_FOLDER/tracking_wal.jsonl``
(the write-ahead log of `MlflowTracker`). This creates the MLflow run the log describes (or continues the one it
names), uploads its metrics in order (steps MLflow already holds are skipped, so running it twice logs nothing
twice), marks the run with the status it ended with, and deletes the log once everything is stored.
Exit status: 0 uploaded (or nothing to do), 1 the store is unreachable or refused the upload, 2 bad input.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from fp8rl.tracking.client import TrackingUnavailable, redact
from fp8rl.tracking.mlflow_tracker import WAL_NAME, MlflowTracker, read_wal, spec_from_record

log = logging.getLogger("fp8rl.tracking.sync")


def sync(run_folder: str | Path, tracking_uri: str | None = None, connect_timeout_s: float = 10.0) -> str:
    """Upload `run_folder`'s write-ahead log; returns the MLflow run id. `tracking_uri` defaults to
    $MLFLOW_TRACKING_URI, then to the store the run was configured with."""
    wal = Path(run_folder) / WAL_NAME
    records = read_wal(wal)
    if not records:
        raise FileNotFoundError(f"{wal} does not exist or is empty: nothing to upload from {run_folder}")
    start = next((r for r in records if r["kind"] == "start"), None)
    run = next((r for r in records if r["kind"] == "run"), None)
    if start is None and run is None:
        raise ValueError(f"{wal} names no run and no run description: it was not written by fp8rl")
    spec_record = (start or {}).get("spec", {})
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or spec_record.get("tracking_uri")
    if not uri or "***" in uri:
        raise ValueError(f"no tracking URI for {run_folder}: pass --tracking-uri (the run's own is redacted)")
    spec = spec_from_record({"experiment": "fp8rl", "run_name": Path(run_folder).name, **spec_record}, uri)
    tracker = MlflowTracker(spec, run_folder, connect_timeout_s, offline_ok=False)
    status = next((r["status"] for r in reversed(records) if r["kind"] == "end"), "KILLED")
    tracker.finish(status)
    if wal.exists():
        raise TrackingUnavailable(f"some records did not reach {redact(uri)}; they stay in {wal}")
    return tracker.run_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fp8rl sync", description=__doc__.split("\n")[0])
    parser.add_argument("run_folder", help="the run's folder (trainer.out_dir), holding tracking_wal.jsonl")
    parser.add_argument("--tracking-uri", default=None, help="the MLflow store (default: $MLFLOW_TRACKING_URI)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        run_id = sync(args.run_folder, args.tracking_uri)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except TrackingUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"uploaded {args.run_folder} to MLflow run {run_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
