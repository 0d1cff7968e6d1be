"""The RL loop and its tracking."""

from __future__ import annotations

from dataclasses import dataclass

from fp8rl.config.fields import _require, option


@dataclass(frozen=True)
class TrainerConfig:
    """The RL loop."""

    steps: int = option(100, "RL steps")
    seed: int = option(0, "seeds prompts, sampling and everything else")
    checkpoint_every: int = option(10, "checkpoint every N steps; 0 = only at the end")
    keep_checkpoints: int = option(2, "most recent checkpoints kept")
    out_dir: str | None = option(
        None, "checkpoints and run files; None = outputs/runs/<run name>-<config hash>", hashed=False
    )
    resume: bool = option(
        True, "continue from the newest checkpoint in out_dir (false: move it aside, start fresh)", hashed=False
    )
    max_bad_steps: int = option(3, "stop after this many non-finite steps in a row")
    export_every: int = option(
        0, "write a Hugging Face checkpoint (run folder's hf/) every N steps; 0 = never", neutral=(0,)
    )
    shadow_every: int = option(0, "fp8_full: BF16 shadow diagnostics every N steps; 0 = calibration steps only")
    log_ratio_histograms: bool = option(True, "log BF16-shadow vs FP8 ratio histograms on shadow steps")
    threads: int = option(0, "torch intra-op threads; 0 = torch's default", hashed=False)

    def __post_init__(self) -> None:
        _require(self.steps >= 1, "trainer.steps must be >= 1")
        _require(self.checkpoint_every >= 0, f"trainer.checkpoint_every={self.checkpoint_every} must be >= 0")
        _require(self.keep_checkpoints >= 1, f"trainer.keep_checkpoints={self.keep_checkpoints} must be >= 1")
        _require(self.max_bad_steps >= 0, f"trainer.max_bad_steps={self.max_bad_steps} must be >= 0")
        _require(self.shadow_every >= 0, "trainer.shadow_every must be >= 0")
        _require(self.threads >= 0, "trainer.threads must be >= 0")


@dataclass(frozen=True)
class TrackingConfig:
    """MLflow tracking."""

    enabled: bool = option(True, "false = no MLflow (tests)", hashed=False)
    tracking_uri: str | None = option(
        None, "None = $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working dir", hashed=False
    )
    experiment: str = option("fp8rl", "MLflow experiment", hashed=False)
    run_name: str | None = option(None, "MLflow run name (default: derived from the config)", hashed=False)
    parent_run_id: str | None = option(None, "nest this run under a sweep's parent run", hashed=False)
    tags: dict[str, str] = option({}, "extra tags (sweep axes)", hashed=False)
    connect_timeout_s: float = option(10.0, "how long the store may take to answer before the run starts", hashed=False)
    offline: bool = option(
        False, "store unreachable: train anyway, buffer locally, upload when it returns", hashed=False
    )

    def __post_init__(self) -> None:
        _require(self.connect_timeout_s > 0, "tracking.connect_timeout_s must be > 0")
