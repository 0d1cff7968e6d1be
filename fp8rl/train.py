"""Hydra entry point: ``python -m fp8rl.train [group=choice ...] [section.field=value ...]``.

The Hydra config is converted into one typed `RunConfig` and validated before anything is built;
a bad combination exits with status 2 and a message that says what to change.
"""

from __future__ import annotations

import logging
import sys

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from fp8rl._warnings import silence_expected_warnings
from fp8rl.config import ConfigError, RunConfig, from_dict, validate

ConfigStore.instance().store(name="run_config_schema", node=RunConfig)
log = logging.getLogger("fp8rl")


silence_expected_warnings()


def resolve(cfg: DictConfig) -> RunConfig:
    """Hydra config -> validated RunConfig (raises ConfigError)."""
    import torch

    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    return validate(from_dict(container), cuda_available=torch.cuda.is_available())


@hydra.main(version_base="1.3", config_path="../sweeps", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        run_cfg = resolve(cfg)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
    from fp8rl.trainer.run import run

    summary = run(run_cfg)
    log.info("done: %d steps, run %s, final eval %s", summary.steps_done, summary.run_id, summary.final_eval)


if __name__ == "__main__":
    main()
