"""A run's identity: the config hash that sweeps skip finished runs by, its folder, and the config back from
the flat params an MLflow run holds.

A field added after runs were published must not change their hash: `HASH_NEUTRAL` names the value that
reproduces the behaviour from before it existed, and at that value the field is left out of the hash (a test
recomputes published runs' hashes from their params).
"""

from __future__ import annotations

import ast
import hashlib
import json
from collections.abc import Mapping
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

from fp8rl.config import ConfigError, RunConfig, flatten, from_dict, section_types, to_dict
from fp8rl.quant.recipes import legacy_pow2_scale, recipe_of

# Fields that change where or how a run is stored or how fast it runs, not what it computes.
HASH_EXCLUDED = (
    "tracking",
    "trainer.out_dir",
    "trainer.resume",
    "trainer.threads",
    "trainer.keep_freed_memory",
    "warmstart.cache_dir",
    "warmstart.eval_batch_size",
)
# Fields added after runs were published, with the value that reproduces the behaviour from before they
# existed: at that value they are left out of the hash, so finished runs keep their identity.
HASH_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "parallel.": (None,),
    "algo.resample_rounds": (None, 0),
    "clipping.pool_neg_tokens": (0,),
    "clipping.first_step": (None,),
    "precision.amax_history_len": (16,),
    "precision.amax_compute_algo": ("max",),
    "precision.margin": (0,),
    "precision.compute": ("bf16",),
    "precision.amax_reduction": ("te",),
    "trainer.export_every": (0,),
    "model.hf_path": (None,),
    "task.dataset": (None,),
    "task.path": (None,),
    "task.split": (None,),
    "task.eval_sets": ((), []),
    "task.eval_paths": ({},),
    "task.chat_template": (True,),
    "task.max_response_tokens": (None,),
    "task.overlong_prompts": ("refuse",),  # runs before it had no prompt too long (those could not run)
    "eval.samples": (1,),
    "eval.temperature": (0.6,),
    "eval.top_p": (0.95,),
    "eval.bf16": (False,),
    "warmstart.weight_decay": (0.0,),
    "warmstart.grad_clip": (1.0,),
    "warmstart.precision": ("bf16",),
    "warmstart.stop_accuracy": (None,),
    "warmstart.check_every": (20,),
    "task.min_operands": (4,),
    "task.max_operands": (9,),
    "task.junk_tokens": (16,),
    "clipping.synthetic_overclip_std": (0.0,),
    "precision.pow2_scale": (None,),  # hashed as run: `resolved_recipe` (None = the scale rounding of that time)
}
# Fields renamed since runs were published: hashed under their old name.
HASH_LEGACY_NAMES = {"eval.every": "trainer.eval_every", "eval.size": "trainer.eval_size"}


def hash_view(cfg: RunConfig) -> dict[str, Any]:
    """The flat fields that define what a run computes, under the names finished runs were hashed with."""
    flat = {**flatten(to_dict(cfg)), **resolved_recipe(cfg)}
    view = {}
    for key, value in flat.items():
        if any(key == e or key.startswith(e + ".") for e in HASH_EXCLUDED):
            continue
        neutral = next((v for k, v in HASH_NEUTRAL.items() if key == k or (k.endswith(".") and key.startswith(k))), ())
        if _is_neutral(value, neutral):
            continue
        view[HASH_LEGACY_NAMES.get(key, key)] = list(value) if isinstance(value, tuple) else value
    return view


def resolved_recipe(cfg: RunConfig) -> dict[str, Any]:
    """The FP8 format and scale rounding a run computes with, as hashed: the recipe's preset resolved, so that a
    change of a preset is a change of identity. Runs from before the presets were TorchAO's logged `precision.fmt`
    and had no `precision.pow2_scale`: the rounding of that time (`legacy_pow2_scale`) hashes as None (neutral),
    and a BF16 run, which quantizes nothing, hashes the values of that time."""
    p = cfg.precision
    if p.mode == "bf16":
        return {"precision.fmt": p.fmt or "e4m3", "precision.pow2_scale": None}
    recipe = recipe_of(p)
    pow2 = None if recipe.pow2_scale == legacy_pow2_scale(p.recipe) else recipe.pow2_scale
    return {"precision.fmt": recipe.fmt, "precision.pow2_scale": pow2}


def without_neutral(section: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """A section's fields without those at their `HASH_NEUTRAL` value (e.g. for a cache key that must not change
    when a field is added)."""
    out = {}
    for name, value in values.items():
        key = f"{section}.{name}"
        neutral = next((v for k, v in HASH_NEUTRAL.items() if key == k or (k.endswith(".") and key.startswith(k))), ())
        if not _is_neutral(value, neutral):
            out[name] = value
    return out


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    return any(value == n and type(value) is type(n) or (value is None and n is None) for n in neutral)


def from_params(params: Mapping[str, str]) -> RunConfig:
    """A RunConfig from the flat string params an MLflow run holds (also those logged before fields were
    renamed: `HASH_LEGACY_NAMES`), e.g. to recompute a published run's config hash."""
    legacy = {old: new for new, old in HASH_LEGACY_NAMES.items()}
    nested: dict[str, dict[str, Any]] = {}
    sections = section_types()
    for key, text in params.items():
        section, _, name = legacy.get(key, key).partition(".")
        if section not in sections:
            raise ConfigError(f"param {key!r} is not <section>.<field>")
        if section == "tracking" and name.startswith("tags."):
            nested.setdefault(section, {}).setdefault("tags", {})[name.removeprefix("tags.")] = text
            continue
        hint = get_type_hints(sections[section]).get(name)
        if hint is None:
            raise ConfigError(f"param {key!r}: section {section!r} has no field {name!r}")
        nested.setdefault(section, {})[name] = _parse_param(text, hint)
    precision = nested.setdefault("precision", {})
    if "pow2_scale" not in precision:  # logged before the field existed: the rounding of that time
        precision["pow2_scale"] = legacy_pow2_scale(precision.get("recipe", "tensorwise"))
    return from_dict(nested)


def _parse_param(text: str, hint: Any) -> Any:
    """A param's string back into the field's type (MLflow stores str(value))."""
    if text == "None":
        return None
    is_union = get_origin(hint) in (Union, UnionType)  # Optional[X] / X | None: X; tuple[str, ...]: itself
    kinds = [a for a in get_args(hint) if a is not type(None)] if is_union else [hint]
    kind = get_origin(kinds[0]) or kinds[0]
    if kind is bool:
        return text == "True"
    if kind in (int, float):
        return kind(text)
    if kind in (tuple, dict, list):
        return ast.literal_eval(text)
    return text


def config_hash(cfg: RunConfig) -> str:
    """Identity of what a run computes (sweeps skip finished runs by it; the default run folder uses it)."""
    return hashlib.sha256(json.dumps(hash_view(cfg), sort_keys=True, default=str).encode()).hexdigest()[:16]


def default_run_name(cfg: RunConfig) -> str:
    """``<algo>-<precision>[-<recipe>]-<clipping>-s<seed>``."""
    p = cfg.precision
    precision = p.mode if p.mode == "bf16" else f"{p.mode}-{p.recipe}"
    return f"{cfg.algo.name}-{precision}-{cfg.clipping.policy}-s{cfg.trainer.seed}"


def run_dir(cfg: RunConfig) -> str:
    """Where the run keeps its checkpoints and files: trainer.out_dir, else one folder per config hash, so
    that the same command continues the same run."""
    return cfg.trainer.out_dir or f"outputs/runs/{default_run_name(cfg)}-{config_hash(cfg)}"
