"""The job: the one place where a run is set up on every rank (process, distributed, preflight, provenance,
tracker, resume) and its parts are built and handed to the trainer. See `fp8rl.job.run`."""

from fp8rl.job.run import build_trainer, run_job

__all__ = ["build_trainer", "run_job"]
