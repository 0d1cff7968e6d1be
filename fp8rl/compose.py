"""Compose run configs from the Hydra config tree in ``sweeps/``, exactly as ``python -m fp8rl.train
<overrides>`` would (``${hydra:...}`` interpolations resolved), without running anything.

Used by the sweep planner (`fp8rl.launch.experiment`), the studies and the demo, so that an arm means the
same config everywhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from fp8rl.config import RunConfig, from_dict

SWEEPS_DIR = Path(__file__).resolve().parents[1] / "sweeps"


@contextlib.contextmanager
def hydra_context(sweeps_dir: Path = SWEEPS_DIR) -> Iterator[None]:
    """Hydra initialised on `sweeps_dir` with the RunConfig schema registered (cleared first)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from fp8rl.schema import register_schema

    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(sweeps_dir), version_base="1.3"):
        yield


def compose(overrides: Sequence[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """(resolved config as a dict, Hydra's group choices) of one point; call inside `hydra_context`."""
    from hydra import compose as hydra_compose
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    cfg = hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    choices = {k: str(v) for k, v in cfg.hydra.runtime.choices.items() if v is not None and not k.startswith("hydra/")}
    HydraConfig.instance().set_config(cfg)
    try:
        with open_dict(cfg):
            del cfg["hydra"]
        container = OmegaConf.to_container(cfg, resolve=True)
    finally:
        HydraConfig.instance().cfg = None
    return container, choices  # type: ignore[return-value]


def sweeper_params(overrides: Sequence[str]) -> dict[str, str]:
    """An experiment's ``hydra.sweeper.params`` (its axes); call inside `hydra_context`."""
    from hydra import compose as hydra_compose

    cfg = hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    return dict(cfg.hydra.sweeper.params or {})


def compose_config(overrides: Sequence[str], sweeps_dir: Path = SWEEPS_DIR) -> RunConfig:
    """The RunConfig of `overrides` (raises ConfigError for a structurally bad one; registry names are
    checked by `fp8rl.choices.validated`)."""
    with hydra_context(sweeps_dir):
        container, _ = compose(overrides)
    return from_dict(container)
