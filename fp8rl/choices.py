"""The named choices a run config makes, checked against the registries that own the names.

`fp8rl.config` knows no registry (it is the ground floor); this module maps each registry-backed field to
its registry, so a typo (``algo.advantage=grpoo``, ``task.name=nope``) fails when the config is built,
listing the valid names, before a model, a warm start or an MLflow run exists. `validated` is what every
entry point calls on a freshly built config. Importing it imports torch (the registries live in the
pure-maths packages), never megatron, vLLM or MLflow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from fp8rl.algos import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATION_MODES,
    CLIP_BOUND_POLICIES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    ROLLOUT_CORRECTIONS,
    get_clip_bound_policy,
)
from fp8rl.config import ConfigError, RunConfig
from fp8rl.models.config import model_preset_names
from fp8rl.models.te_recipes import check_backend_supports
from fp8rl.quant.recipes import AMAX_COMPUTE_ALGOS, FORMAT_MODES, RECIPE_NAMES, SCALING_MODES, recipe_of
from fp8rl.rollout.base import ROLLOUT_ENGINES
from fp8rl.tasks import check_task_config, dataset_names, task_names

# field -> the names it may take (a callable: registries can grow after import)
CHOICES: dict[str, Callable[[], Iterable[str]]] = {
    "algo.advantage": ADVANTAGE_ESTIMATORS.names,
    "algo.policy_loss": POLICY_LOSSES.names,
    "algo.kl_type": KL_ESTIMATORS.names,
    "algo.loss_agg": lambda: AGGREGATION_MODES,
    "precision.recipe": lambda: RECIPE_NAMES,
    "precision.fmt": lambda: (None, *FORMAT_MODES),  # None: the recipe's preset
    "precision.scaling": lambda: SCALING_MODES,
    "precision.amax_compute_algo": lambda: AMAX_COMPUTE_ALGOS,
    "precision.amax_reduction": lambda: ("te", "tp_invariant"),
    "clipping.policy": CLIP_BOUND_POLICIES.names,
    "clipping.rollout_correction": ROLLOUT_CORRECTIONS.names,
    "rollout.engine": lambda: ROLLOUT_ENGINES,
    "model.preset": model_preset_names,
    "task.name": task_names,
}


def _value(cfg: RunConfig, dotted: str) -> object:
    section, name = dotted.split(".")
    return getattr(getattr(cfg, section), name)


def check_choices(cfg: RunConfig) -> None:
    """Raise ConfigError for the first field whose name is not registered, listing the valid names."""
    for dotted, names in CHOICES.items():
        valid = sorted(names(), key=str)
        value = _value(cfg, dotted)
        if value not in valid:
            raise ConfigError(f"{dotted}={value!r} is not valid; choose one of {valid}")
    datasets = dataset_names()
    for dotted, values in (("task.dataset", [cfg.task.dataset]), ("task.eval_sets", cfg.task.eval_sets)):
        for value in values:
            if value is not None and value not in datasets:
                raise ConfigError(f"{dotted}: {value!r} is not a known data set; choose from {datasets}")
    if cfg.model.device == "cpu" and cfg.model.preset != "tiny" and cfg.model.hf_path is None:
        raise ConfigError(
            f"model.preset={cfg.model.preset} is a GPU-scale model: on CPU use model.preset=tiny (or model.hf_path=<a "
            "small checkpoint>), or set model.device=cuda"
        )
    errors = get_clip_bound_policy(cfg.clipping.policy).config_errors(cfg.algo, cfg.clipping, cfg.precision)
    if errors:
        raise ConfigError(errors[0])
    try:
        check_task_config(cfg.task)
        if cfg.precision.mode != "bf16":
            check_backend_supports(recipe_of(cfg.precision), cfg.precision.backend)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def validated(cfg: RunConfig) -> RunConfig:
    """`cfg` after the registry checks (its sections checked themselves when they were built)."""
    check_choices(cfg)
    return cfg
