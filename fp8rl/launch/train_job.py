"""The callable a sweep submits: one training run, checkpointable and requeueable through submitit.

`TrainJob` holds a resolved config (a plain dict, so the pickle does not depend on dataclass layout)
and the time it was submitted. Every task of the job (one per rank) runs it: `fp8rl.job.run_job` forms the
process group from Slurm's environment. On Slurm's timeout/preemption signal submitit calls `checkpoint()`,
which resubmits the same job: the state lives in the trainer's own checkpoints under ``trainer.out_dir`` (a
deterministic folder per sweep and config hash), so the requeued job resumes from the newest one and
continues the same MLflow run (left SCHEDULED in between).

This module imports no torch at import time: a job unpickles it before doing anything else.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from typing import Any

import submitit

log = logging.getLogger(__name__)


def job_config(cfg: Any) -> dict[str, Any]:
    """The config a job is pickled with (submitit writes it to the sweep's folder, often on a shared disk). A
    tracking URI that carries credentials is left out of it: the job reads the URI from $MLFLOW_TRACKING_URI,
    which it inherits from this process (submitit's local jobs copy the environment; Slurm exports it by
    default), and `tracking.tracking_uri` is not part of a run's identity."""
    from fp8rl.config import to_dict
    from fp8rl.tracking.client import redact

    job = to_dict(cfg)
    uri = cfg.tracking.tracking_uri
    if uri and redact(uri) != uri:
        os.environ["MLFLOW_TRACKING_URI"] = uri
        job["tracking"]["tracking_uri"] = None
    return job


class JobFailed(RuntimeError):
    """A job's error whose text held credentials: the redacted traceback, in place of the original."""


class TrainJob(submitit.helpers.Checkpointable):
    """Run (or resume) one configured training run; returns a small summary dict (rank 0's is the job's), or
    ``{"held_by": ...}`` when another process holds the run folder (a second launch of the same sweep)."""

    def __init__(self, cfg: dict[str, Any], submitted_at: float | None = None) -> None:
        self.cfg = cfg
        self.submitted_at = submitted_at if submitted_at is not None else time.time()

    def __call__(self) -> dict[str, Any]:
        from fp8rl.choices import validated
        from fp8rl.config import from_dict
        from fp8rl.identity import config_hash
        from fp8rl.job import run_job
        from fp8rl.job.lock import RunFolderInUse
        from fp8rl.tracking.client import redact, redact_stderr

        redact_stderr()  # submitit keeps the job's stderr in a file beside its pickles
        cfg = validated(from_dict(self.cfg))
        try:
            summary = run_job(cfg, submitted_at=self.submitted_at)
        except RunFolderInUse as held:  # another launch of the sweep took this point first: its run, not a failure
            return {"held_by": str(held), "config_hash": config_hash(cfg)}
        except Exception:  # submitit pickles what the job raised: its text may quote a credentialed URI
            text = traceback.format_exc()
            if redact(text) == text:
                raise
            raise JobFailed(redact(text)) from None
        return {
            "run_id": summary.run_id,
            "config_hash": config_hash(cfg),
            "steps_done": summary.steps_done,
            "final_eval": summary.final_eval,
            "out_dir": summary.out_dir,
        }

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Requeue this job unchanged: the trainer's checkpoints in trainer.out_dir carry the state."""
        from fp8rl.job.signals import mark_requeued

        mark_requeued()
        log.info("checkpoint requested: requeueing; the run resumes from %s", self.cfg["trainer"]["out_dir"])
        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)
