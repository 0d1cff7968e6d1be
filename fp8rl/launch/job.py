"""The callable a sweep submits: one training run, checkpointable and requeueable through submitit.

`TrainJob` holds a resolved config (a plain dict, so the pickle does not depend on dataclass layout)
and the time it was submitted. On Slurm's timeout/preemption signal submitit calls `checkpoint()`,
which resubmits the same job: the state lives in the trainer's own checkpoints under
``trainer.out_dir`` (a deterministic folder per sweep and config hash), so the requeued job resumes
from the newest one and continues the same MLflow run, skipping the steps MLflow already has.

This module imports no torch at import time: a job unpickles it before doing anything else.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import submitit

from fp8rl.config import RunConfig, from_dict

log = logging.getLogger(__name__)


class TrainJob(submitit.helpers.Checkpointable):
    """Run (or resume) one configured training run; returns a small summary dict."""

    def __init__(self, cfg: dict[str, Any], submitted_at: float | None = None) -> None:
        self.cfg = cfg
        self.submitted_at = submitted_at if submitted_at is not None else time.time()

    def __call__(self) -> dict[str, Any]:
        from fp8rl.launch.distributed import dist_env_from_environ, init_distributed, shutdown_distributed

        started_at = time.time()
        env = dist_env_from_environ()
        init_distributed(env)
        try:
            if env.rank != 0:
                # The trainer is single-process: rank 0 trains and tracks, the other ranks only join the group.
                return {"rank": env.rank, "skipped": "the trainer runs on rank 0 only"}
            return train(from_dict(self.cfg), self.submitted_at, started_at)
        finally:
            shutdown_distributed()

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Requeue this job unchanged: the trainer's checkpoints in trainer.out_dir carry the state."""
        log.info("checkpoint requested: requeueing; the run resumes from %s", self.cfg["trainer"]["out_dir"])
        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


def train(cfg: RunConfig, submitted_at: float, started_at: float) -> dict[str, Any]:
    """Resume or start the run; skip it when MLflow already has it finished (a requeue that raced the end)."""
    from fp8rl.launch.tracking import AsyncTracker
    from fp8rl.trainer.run import config_hash, make_tracker, run

    digest = config_hash(cfg)
    tracker = None
    if cfg.tracking.enabled:
        finished, resumable = existing_runs(cfg, digest)
        if finished:
            return {"run_id": finished, "config_hash": digest, "already_finished": True, "out_dir": cfg.trainer.out_dir}
        wal = Path(cfg.trainer.out_dir) / "tracking_wal.jsonl"
        tracker = AsyncTracker(make_tracker(cfg, resumable), wal, submitted_at, started_at)
        tracker.set_tags(_attempt_tags(cfg))
    summary = run(cfg, tracker=tracker)
    return {
        "run_id": summary.run_id,
        "config_hash": digest,
        "steps_done": summary.steps_done,
        "final_eval": summary.final_eval,
        "out_dir": summary.out_dir,
    }


def _attempt_tags(cfg: RunConfig) -> dict[str, str]:
    """Where this attempt starts: the checkpoint it resumes from, and Slurm's restart count."""
    from fp8rl.trainer import checkpoint as ckpt

    latest = ckpt.latest_checkpoint(cfg.trainer.out_dir)
    return {
        "fp8rl.resumed_from": latest.name if latest else "none",
        "fp8rl.slurm_restarts": os.environ.get("SLURM_RESTART_COUNT", "0"),
    }


def existing_runs(cfg: RunConfig, digest: str) -> tuple[str | None, str | None]:
    """(a FINISHED run of this config, else None; the newest unfinished one to continue, else None).

    Looked up in MLflow rather than in the checkpoint so that a job killed before its first checkpoint
    still continues its run instead of opening a second one.
    """
    from fp8rl.launch import runs

    t = cfg.tracking
    mlflow_client = runs.client(runs.absolute_tracking_uri(t.tracking_uri))
    exp_id = runs.experiment_id(mlflow_client, t.experiment, create=False)
    if exp_id is None:
        return None, None
    found = runs.child_runs(mlflow_client, exp_id, config_hash=digest, parent_id=t.parent_run_id)
    finished = next((r.info.run_id for r in found if r.info.status == "FINISHED"), None)
    unfinished = next((r.info.run_id for r in found if r.info.status != "FINISHED"), None)
    return finished, unfinished
