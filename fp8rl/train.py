"""Hydra entry point: ``python -m fp8rl.train [group=choice ...] [section.field=value ...]``.

The Hydra config becomes one typed `RunConfig`, checked (fields, combinations, registry names) before
anything is built; then `fp8rl.job.run_job` runs it (preflight first). A config or environment that cannot
run exits with status 2 and a message that says what to change. Under ``torchrun`` (or a Slurm task) every
rank runs this entry point: the job forms the process group from the launcher's environment.
"""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from fp8rl._warnings import silence_expected_warnings
from fp8rl.config import ConfigError, RunConfig, from_dict
from fp8rl.schema import register_schema

register_schema()
silence_expected_warnings()
log = logging.getLogger("fp8rl")
INTERRUPTED = "interrupted (Ctrl-C): the run is marked KILLED; the same command resumes it from its last checkpoint"


def resolve(cfg: DictConfig) -> RunConfig:
    """Hydra config -> checked RunConfig (raises ConfigError)."""
    from fp8rl.choices import validated

    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    return validated(from_dict(container))


def unswept_axes(mode: str, sweep_params: dict, overrides: list[str]) -> list[str]:
    """The axes of an experiment's sweep that a single run (no ``-m``) would silently leave at the base point:
    those the command line does not set itself."""
    if mode != "RUN" or not sweep_params:
        return []
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    return [axis for axis in sweep_params if axis.lstrip("+~") not in given]


def check_single_run(hydra_cfg) -> None:
    """Refuse an experiment run without ``-m`` whose sweep axes are not all pinned (it would train one point)."""
    axes = unswept_axes(str(hydra_cfg.mode.name), dict(hydra_cfg.sweeper.params or {}), list(hydra_cfg.overrides.task))
    if axes:
        raise ConfigError(
            f"this experiment sweeps {', '.join(axes)}, but without -m only its first point would train: add -m "
            "(python -m fp8rl.train -m experiment=...), use `fp8rl sweep <experiment>`, or set every swept axis "
            "on the command line to train one point"
        )


@hydra.main(version_base="1.3", config_path="../sweeps", config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from fp8rl.tracking import TrackingUnavailable
    from fp8rl.tracking.client import redact_stderr

    redact_stderr()  # a traceback Hydra prints may quote an MLflow error that names the URI with its token
    try:
        check_single_run(HydraConfig.get())
        run_cfg = resolve(cfg)
        from fp8rl.job import run_job

        summary = run_job(run_cfg, hydra_dir=HydraConfig.get().runtime.output_dir)
    except (ConfigError, TrackingUnavailable) as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # one line, not the 60-line traceback of every frame it passed through
        print(INTERRUPTED, file=sys.stderr)
        sys.exit(130)
    log.info("done: %d steps, MLflow run %s, final eval %s", summary.steps_done, summary.run_id, summary.final_eval)


if __name__ == "__main__":
    main()
