"""A run's identity: the config hash that sweeps skip finished runs by, its folder, and the config back from
the flat params an MLflow run holds.

Which fields enter the hash is declared where each field is declared (`fp8rl.config.option`: ``hashed=False``
for where and how fast a run runs; ``neutral`` for a field added after runs were published, the value that
reproduces the behaviour from before it existed, at which the field is left out; `precision.kv_cache_scales`
is also left out where there is no FP8 KV cache, since it computes nothing there). A test recomputes the
published runs' hashes from their params, so a field added without its neutral value fails it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

from fp8rl.config import ConfigError, RunConfig, flatten, from_dict, section_types, to_dict
from fp8rl.quant.recipes import legacy_pow2_scale, recipe_of


@functools.cache
def identity_rules() -> tuple[tuple[str, ...], dict[str, tuple[Any, ...]]]:
    """(the fields left out of the hash, the neutral values of fields added later), as each field declares them
    (`fp8rl.config.option`'s ``hashed`` and ``neutral``): nothing to keep in step by hand."""
    unhashed, neutral = [], {}
    for section, cls in section_types().items():
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            if not f.metadata.get("hashed", True):
                unhashed.append(key)
            if f.metadata.get("neutral"):
                neutral[key] = f.metadata["neutral"]
    return tuple(unhashed), neutral


# Fields renamed since runs were published: hashed under their old name.
HASH_LEGACY_NAMES = {"eval.every": "trainer.eval_every", "eval.size": "trainer.eval_size"}
# Fields removed since runs were published (none of them was hashed): skipped when a run's params are read back.
REMOVED_FIELDS = ("trainer.keep_freed_memory",)


def hash_view(cfg: RunConfig) -> dict[str, Any]:
    """The flat fields that define what a run computes, under the names finished runs were hashed with."""
    flat = {**flatten(to_dict(cfg)), **resolved_recipe(cfg)}
    if not cfg.precision.fp8_kv_cache:  # the KV cache's scales compute nothing without an FP8 KV cache
        flat.pop("precision.kv_cache_scales")
    unhashed, neutral_values = identity_rules()
    view = {}
    for key, value in flat.items():
        if any(key == e or key.startswith(e + ".") for e in unhashed):
            continue
        if _is_neutral(value, neutral_values.get(key, ())):
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


def hashed_fields(section: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """A section's fields as the hash sees them: without the unhashed ones and those at their neutral value
    (the warm-start cache key uses the same rule as the run's hash)."""
    unhashed, neutral_values = identity_rules()
    out = {}
    for name, value in values.items():
        key = f"{section}.{name}"
        if key not in unhashed and not _is_neutral(value, neutral_values.get(key, ())):
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
        if key in REMOVED_FIELDS:
            continue
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
    precision.setdefault("kv_cache_scales", "unit")  # logged before the field existed: unit scales
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
