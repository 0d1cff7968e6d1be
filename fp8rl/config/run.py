"""`RunConfig` composes the sections; rules that span sections; dicts in and out."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, get_args, get_origin, get_type_hints

from fp8rl.config.algo import AlgoConfig, ClippingConfig
from fp8rl.config.fields import ConfigError, _require
from fp8rl.config.model import ParallelConfig, PolicyConfig, RolloutConfig
from fp8rl.config.precision import PrecisionConfig
from fp8rl.config.task import EvalConfig, TaskConfig, WarmStartConfig
from fp8rl.config.trainer import TrackingConfig, TrainerConfig


@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs."""

    algo: AlgoConfig = field(default_factory=AlgoConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    clipping: ClippingConfig = field(default_factory=ClippingConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    model: PolicyConfig = field(default_factory=PolicyConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        check_combinations(self)


def check_combinations(cfg: RunConfig) -> None:
    """Rules that span sections (each section checks its own fields when it is built)."""
    a, c, p = cfg.algo, cfg.clipping, cfg.precision
    low = c.init_low if c.init_low is not None else 1 - a.eps_low
    high = c.init_high if c.init_high is not None else 1 + a.eps_high
    bounds = f"clipping.init_low={low}, init_high={high}"
    _require(0 < low < 1 < high, f"clip bounds must satisfy 0 < low < 1 < high, got {bounds}")
    updates = a.num_minibatches * a.ppo_epochs
    _require(
        not cfg.trainer.shadow_every or updates >= 2,
        "trainer.shadow_every compares ratios after an update: set algo.num_minibatches >= 2",
    )
    _require(
        cfg.model.device == "cuda" or p.backend != "te",
        "precision.backend=te (Transformer Engine) runs on a CUDA GPU: set model.device=cuda, or use "
        "precision.backend=emulated on CPU",
    )
    _require(
        p.backend != "torchao" or p.amax_reduction == "te",
        "precision.amax_reduction=tp_invariant is the emulator's: torchao scales each rank's shard itself; use "
        "precision.backend=emulated for it",
    )
    if cfg.task.name == "math":
        _require(cfg.task.dataset is not None, "task.name=math needs task.dataset (dapo_math_17k or deepscaler)")
        _require(
            cfg.model.hf_path is not None,
            "task.name=math prompts with the model's own tokenizer: set model.hf_path=<checkpoint folder or hub id>",
        )
        _require(
            bool(cfg.task.eval_sets),
            "task.name=math evaluates on task.eval_sets, which is empty (its accuracy would be the mean of nothing): "
            "name at least one benchmark, e.g. task.eval_sets=[math500] (aime24, aime25, amc23, math500)",
        )


# ---------------------------------------------------------------------------------------------------- dicts
def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain nested dict of the config (for hashing, logging and YAML)."""
    return dataclasses.asdict(cfg)


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def section_types() -> dict[str, type]:
    """Section name -> its config class."""
    hints = get_type_hints(RunConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(RunConfig)}


def from_dict(d: Mapping[str, Any]) -> RunConfig:
    """A RunConfig from a nested dict (e.g. OmegaConf.to_container of the Hydra config); unknown keys raise."""
    sections = section_types()
    kwargs = {}
    for name, value in d.items():
        if name not in sections:
            raise ConfigError(f"unknown config section {name!r}; valid sections: {sorted(sections)}")
        kwargs[name] = _section_from_dict(sections[name], name, value or {})
    return RunConfig(**kwargs)


def _section_from_dict(cls: type, name: str, values: Mapping[str, Any]) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"unknown field(s) {sorted(unknown)} in section {name!r}; valid: {sorted(known)}")
    hints = get_type_hints(cls)
    coerced = {k: tuple(v) if _is_tuple(hints[k]) and isinstance(v, list) else v for k, v in values.items()}
    return cls(**coerced)


def _is_tuple(hint: Any) -> bool:
    return get_origin(hint) is tuple or any(get_origin(a) is tuple for a in get_args(hint))


def with_overrides(cfg: RunConfig, changes: Mapping[str, Any]) -> RunConfig:
    """A copy of `cfg` with dotted-path changes, e.g. ``{"trainer.steps": 2, "algo.lr": 1e-4}`` (checked)."""
    sections: dict[str, dict[str, Any]] = {}
    for dotted, value in changes.items():
        section, _, name = dotted.partition(".")
        if section not in section_types() or not name:
            raise ConfigError(f"{dotted!r} is not <section>.<field>; sections: {sorted(section_types())}")
        sections.setdefault(section, {})[name] = value
    replaced = {}
    for section, values in sections.items():
        current = getattr(cfg, section)
        known = {f.name for f in dataclasses.fields(current)}
        unknown = set(values) - known
        if unknown:
            raise ConfigError(f"unknown field(s) {sorted(unknown)} in section {section!r}; valid: {sorted(known)}")
        replaced[section] = dataclasses.replace(current, **values)
    return dataclasses.replace(cfg, **replaced)
