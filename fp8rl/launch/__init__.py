"""Launching: experiments -> validated sweep points -> submitit jobs (local or Slurm), tracked in MLflow.

Modules: `experiment` (experiment files -> composed points), `launchers` (local / Slurm profiles ->
submitit executors, GPU fit), `sweep` (`run_sweep`, the idempotent runner behind ``fp8rl sweep`` /
``make sweep``), `job` (`TrainJob`, the checkpointable callable it submits), `tracking` (`AsyncTracker`:
MLflow uploads off the training loop), `runs` (MLflow bookkeeping: sweep experiment, parent run,
children by config hash), `compare` (``fp8rl compare``), `distributed` (torch.distributed from Slurm's
environment), `services` (local MLflow server and Slurm for the integration lane and benchmarks).
Nothing here is imported by the trainer or the maths; planning a sweep imports no torch.
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
