"""Experiment tracking (MLflow), reading the store, and provenance; handed to the trainer, never imported
by the maths."""

from fp8rl.tracking.client import TrackingUnavailable, probe_store, redact, resolve_tracking_uri
from fp8rl.tracking.mlflow_tracker import MlflowTracker, NullTracker, RunSpec, Tracker
from fp8rl.tracking.provenance import provenance

__all__ = [
    "MlflowTracker",
    "NullTracker",
    "RunSpec",
    "Tracker",
    "TrackingUnavailable",
    "probe_store",
    "provenance",
    "redact",
    "resolve_tracking_uri",
]
