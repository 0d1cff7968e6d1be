"""Launching: experiments -> validated sweep points -> submitit jobs (local or Slurm), tracked in MLflow.

`run_sweep` is the idempotent runner behind ``fp8rl sweep`` / ``make sweep``; `TrainJob` is the
checkpointable callable it submits; `distributed` sets torch.distributed up from Slurm's environment;
`compare` reads a sweep back from MLflow. Nothing here is imported by the trainer or the maths.
"""

from fp8rl.launch.experiment import SweepDefinition, SweepPoint, expand_experiment, expand_points, list_experiments
from fp8rl.launch.sweep import SweepConfigError, SweepReport, SweepRequest, run_sweep

__all__ = [
    "SweepConfigError",
    "SweepDefinition",
    "SweepPoint",
    "SweepReport",
    "SweepRequest",
    "expand_experiment",
    "expand_points",
    "list_experiments",
    "run_sweep",
]
