"""The run config's schema in Hydra's ConfigStore (name ``run_config_schema``, the first entry of
``sweeps/config.yaml``'s defaults list), so Hydra type-checks every override against `RunConfig`.

The dataclasses are frozen; Hydra merges overrides into the schema node, so the stored node is made
writable (the typing stays). Idempotent.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from fp8rl.config import RunConfig

SCHEMA_NAME = "run_config_schema"


def _writable(node: DictConfig) -> DictConfig:
    OmegaConf.set_readonly(node, False)
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _writable(child)
    return node


def register_schema() -> None:
    """Store `RunConfig` as ``run_config_schema`` (once per process)."""
    store = ConfigStore.instance()
    if SCHEMA_NAME + ".yaml" not in store.repo:
        store.store(name=SCHEMA_NAME, node=_writable(OmegaConf.structured(RunConfig)))
