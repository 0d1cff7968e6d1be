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


def resolve(cfg: DictConfig) -> RunConfig:
    """Hydra config -> checked RunConfig (raises ConfigError)."""
    from fp8rl.choices import validated

    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    return validated(from_dict(container))


@hydra.main(version_base="1.3", config_path="../sweeps", config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from fp8rl.tracking import TrackingUnavailable

    try:
        run_cfg = resolve(cfg)
        from fp8rl.job import run_job

        summary = run_job(run_cfg, hydra_dir=HydraConfig.get().runtime.output_dir)
    except (ConfigError, TrackingUnavailable) as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
    log.info("done: %d steps, MLflow run %s, final eval %s", summary.steps_done, summary.run_id, summary.final_eval)


if __name__ == "__main__":
    main()
