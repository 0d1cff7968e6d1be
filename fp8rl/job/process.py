"""Process-wide settings of a job, applied once at its start (before provenance records them):
torch threads, MLflow's HTTP patience, the loggers (one line per step to stdout and
``train.log``; megatron's INFO chatter silenced)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

from fp8rl.config import TrainerConfig
from fp8rl.tracking.client import RedactingFormatter, bound_mlflow_http

QUIET_LOGGERS = ("megatron", "megatron.core", "torch.distributed", "alembic", "urllib3", "mlflow.system_metrics")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def apply_process_settings(cfg: TrainerConfig) -> None:
    """Threads and MLflow's HTTP patience (a user's own environment values win)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    bound_mlflow_http()


def setup_logging(out_dir: str | Path, rank: int = 0) -> None:
    """fp8rl's INFO lines to stdout and ``<out_dir>/train.log`` (rank 0; other ranks warnings only), credentials
    in any line (an MLflow error naming its URI) redacted."""
    root = logging.getLogger()
    fp8rl_logger = logging.getLogger("fp8rl")
    fp8rl_logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if not any(getattr(h, "_fp8rl", False) for h in root.handlers):
        stream = logging.StreamHandler(sys.stdout)
        stream.setFormatter(RedactingFormatter(LOG_FORMAT))
        stream._fp8rl = True  # type: ignore[attr-defined]
        root.addHandler(stream)
        root.setLevel(logging.WARNING)
    log_file = Path(out_dir) / "train.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    if rank == 0 and not any(getattr(h, "baseFilename", None) == str(log_file.resolve()) for h in root.handlers):
        file_handler = logging.FileHandler(log_file)
        file_handler.setFormatter(RedactingFormatter(LOG_FORMAT))
        root.addHandler(file_handler)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def close_log_file(out_dir: str | Path) -> None:
    """Detach ``<out_dir>/train.log`` (a process may run several jobs: the demo, tests)."""
    path = str((Path(out_dir) / "train.log").resolve())
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "baseFilename", None) == path:
            root.removeHandler(handler)
            handler.close()
