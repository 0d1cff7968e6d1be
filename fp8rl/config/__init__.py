"""One typed config per run: frozen dataclasses, one per component, composed by `RunConfig`.

This package is the ground floor: it imports nothing else from fp8rl. Each section lives with its component's
kin (`algo`: the objective and its clip bounds; `precision`; `model`: the policy, its layout and the rollout
engine; `task`: the task, evaluation and warm start; `trainer`: the loop and tracking) and `run` composes them;
everything is importable from `fp8rl.config`. Each section is the config its component consumes as is (the
clip-bound policy reads `ClippingConfig`, the warm start `WarmStartConfig`, the task builder `TaskConfig`, ...),
so every default has exactly one source: its field. The YAML groups in `sweeps/` only override what differs (a
test says so).

Checks here are structural and pure (ranges, combinations); a bad config raises `ConfigError` naming
the override to change. Names that registries own (losses, advantage estimators, recipes, tasks, model
presets, rollout engines) are checked against those registries by `fp8rl.choices.validated`, and the
machine (CUDA, GPU capability, vLLM, memory, layout) by `fp8rl.preflight`: both run before anything
heavy starts.
"""

from __future__ import annotations

from fp8rl.config.algo import AlgoConfig, ClippingConfig
from fp8rl.config.fields import DEVICES, FP8_BACKENDS, PLACEMENTS, PRECISION_MODES, ConfigError, option
from fp8rl.config.model import ParallelConfig, PolicyConfig, RolloutConfig
from fp8rl.config.precision import PrecisionConfig
from fp8rl.config.run import RunConfig, check_combinations, flatten, from_dict, section_types, to_dict, with_overrides
from fp8rl.config.task import EvalConfig, TaskConfig, WarmStartConfig
from fp8rl.config.trainer import TrackingConfig, TrainerConfig

__all__ = [
    "DEVICES",
    "FP8_BACKENDS",
    "PLACEMENTS",
    "PRECISION_MODES",
    "AlgoConfig",
    "ClippingConfig",
    "ConfigError",
    "EvalConfig",
    "ParallelConfig",
    "PolicyConfig",
    "PrecisionConfig",
    "RolloutConfig",
    "RunConfig",
    "TaskConfig",
    "TrackingConfig",
    "TrainerConfig",
    "WarmStartConfig",
    "check_combinations",
    "flatten",
    "from_dict",
    "option",
    "section_types",
    "to_dict",
    "with_overrides",
]
