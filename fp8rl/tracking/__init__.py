"""Experiment tracking (MLflow) and provenance; handed to the trainer, never imported by the maths."""

from fp8rl.tracking.mlflow_tracker import MlflowTracker, NullTracker, Tracker, resolve_tracking_uri
from fp8rl.tracking.provenance import provenance

__all__ = ["MlflowTracker", "NullTracker", "Tracker", "provenance", "resolve_tracking_uri"]
