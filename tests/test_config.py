"""The run config: impossible combinations and unknown names fail when the config is built, saying what to
change; one source for every default; config hashes of published runs stay valid."""

from __future__ import annotations

import dataclasses
import glob
import json
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

from fp8rl.choices import validated
from fp8rl.config import ConfigError, RunConfig, flatten, from_dict, to_dict, with_overrides
from fp8rl.identity import config_hash, from_params, run_dir

ROOT = Path(__file__).resolve().parents[1]
SWEEPS = ROOT / "sweeps"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"clipping.policy": "calibrated"}, "precision.mode=fp8_full"),
        ({"precision.mode": "fp8_full", "clipping.policy": "calibrated", "algo.num_minibatches": 1}, "num_minibatches"),
        ({"algo.prompts_per_step": 30, "algo.num_minibatches": 4}, "divisible"),
        ({"algo.prompts_per_step": 6, "algo.group_size": 4, "algo.num_minibatches": 4}, "splits groups"),
        ({"algo.num_minibatches": 0}, "num_minibatches=0 must be >= 1"),
        ({"algo.prompts_per_step": 0}, "prompts_per_step=0 must be >= 1"),
        ({"precision.recipe": "blockwise", "precision.scaling": "delayed"}, "tensorwise"),
        ({"precision.backend": "te"}, "model.device=cuda"),
        ({"algo.eps_low": 1.5}, "eps_low"),
        ({"clipping.init_low": 1.1}, "init_low"),
        ({"clipping.first_step": -1}, "first_step=-1 must be >= 0"),
        ({"rollout.temperature": 0.0}, "temperature"),
        ({"precision.fp8_kv_cache": True}, "fp8_kv_cache"),
        ({"algo.group_size": 1}, "group_size"),
        ({"algo.resample_rounds": 2}, "dynamic_sampling"),
        ({"trainer.steps": 0}, "trainer.steps"),
        ({"task.name": "math"}, "task.dataset"),
        (
            {"task.name": "math", "task.dataset": "deepscaler", "model.hf_path": "m", "task.eval_sets": ()},
            "task.eval_sets, which is empty",
        ),
    ],
)
def test_invalid_combinations_raise_with_advice(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        validated(with_overrides(RunConfig(), changes))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"algo.advantage": "grpoo"}, "algo.advantage='grpoo' is not valid; choose one of"),
        ({"algo.policy_loss": "xyz"}, "algo.policy_loss='xyz'"),
        ({"algo.kl_type": "k9"}, "algo.kl_type='k9'"),
        ({"algo.loss_agg": "sum"}, "algo.loss_agg='sum'"),
        ({"task.name": "nope"}, "task.name='nope'"),
        ({"model.preset": "qwen9"}, "model.preset='qwen9'"),
        ({"precision.mode": "fp8_full", "precision.recipe": "fp16"}, "precision.recipe='fp16'"),
        ({"clipping.rollout_correction": "tis"}, "clipping.rollout_correction='tis'"),
        ({"rollout.engine": "sglang"}, "rollout.engine='sglang'"),
        ({"model.preset": "qwen3_8b"}, "model.preset=qwen3_8b is a GPU-scale model"),
        ({"task.operations": "/"}, "task.operations"),
    ],
)
def test_unknown_registry_names_are_refused_with_the_valid_ones(changes: dict, message: str) -> None:
    cfg = with_overrides(RunConfig(), changes)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")) as err:
        validated(cfg)
    assert "[" in str(err.value) or "GPU-scale" in str(err.value) or "subset" in str(err.value)


def test_icepop_is_a_valid_rollout_correction() -> None:
    validated(with_overrides(RunConfig(), {"clipping.rollout_correction": "icepop"}))


def test_defaults_are_valid_and_round_trip() -> None:
    cfg = validated(RunConfig())
    assert from_dict(to_dict(cfg)) == cfg
    assert flatten({"a": {"b": 1, "c": {"d": 2}}}) == {"a.b": 1, "a.c.d": 2}
    assert dataclasses.is_dataclass(cfg) and cfg.__dataclass_params__.frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.trainer.steps = 3  # type: ignore[misc]


def test_unknown_field_is_refused() -> None:
    data = to_dict(RunConfig())
    data["algo"]["eps"] = 0.1
    with pytest.raises(ConfigError, match="unknown field"):
        from_dict(data)
    with pytest.raises(ConfigError, match="unknown field"):
        with_overrides(RunConfig(), {"algo.eps": 0.1})


# ---------------------------------------------------------------------------------------------- one source
GROUPS = ("algo", "precision", "recipe", "clipping", "rollout", "model", "task")


def _composed(overrides: list[str]) -> RunConfig:
    with initialize_config_dir(config_dir=str(SWEEPS), version_base="1.3"):
        from fp8rl.train import resolve

        return resolve(compose(config_name="config", overrides=overrides))


def test_the_composed_default_config_is_the_dataclass_default() -> None:
    assert _composed([]) == RunConfig()


@pytest.mark.parametrize("path", sorted(p for g in GROUPS for p in (SWEEPS / g).glob("*.yaml")), ids=lambda p: p.stem)
def test_no_group_file_restates_a_python_default(path: Path) -> None:
    """A group file only overrides what differs from the dataclass defaults: a restated default is a second
    source that drifts (as clipping.ema once did, 0.0 in Python and 0.5 in YAML)."""
    values = yaml.safe_load(path.read_text()) or {}
    package = path.read_text().splitlines()[0].removeprefix("# @package ").strip()
    defaults = flatten(to_dict(RunConfig()))
    restated = {k: v for k, v in flatten({package: values}).items() if k in defaults and defaults[k] == v}
    assert not restated, f"{path.relative_to(ROOT)} restates defaults {restated}: drop them"


def test_algorithm_library_defaults_agree_with_the_config() -> None:
    """The algos classes the trainer builds from the config have no defaults of their own that disagree."""
    from fp8rl.algos import CalibratedClipBounds
    from fp8rl.algos.corrections import DEFAULT_MIS_HIGH, DEFAULT_MIS_LOW, DEFAULT_TIS_CAP
    from fp8rl.algos.policy_loss import DEFAULT_DUAL_CLIP_C

    cfg = RunConfig()
    cc = {f.name: f.default for f in dataclasses.fields(CalibratedClipBounds)}
    assert (cc["interval"], cc["first_step"], cc["ema"], cc["lower_bound_only"]) == (
        cfg.clipping.interval,
        cfg.clipping.first_step,
        cfg.clipping.ema,
        cfg.clipping.lower_only,
    )
    assert (cc["eps_low"], cc["eps_high"]) == (cfg.algo.eps_low, cfg.algo.eps_high)
    assert (DEFAULT_TIS_CAP, DEFAULT_MIS_LOW, DEFAULT_MIS_HIGH) == (
        cfg.clipping.tis_cap,
        cfg.clipping.mis_low,
        cfg.clipping.mis_high,
    )
    assert cfg.algo.dual_clip_c == DEFAULT_DUAL_CLIP_C


@pytest.mark.parametrize("algo", ["grpo", "dapo"])
@pytest.mark.parametrize("precision", ["bf16", "fp8_rollout", "fp8_full"])
@pytest.mark.parametrize("clipping", ["standard", "tis", "calibrated"])
def test_every_group_combination_composes_and_validates_or_explains(algo: str, precision: str, clipping: str) -> None:
    overrides = [f"algo={algo}", f"precision={precision}", f"clipping={clipping}"]
    if clipping == "calibrated" and precision != "fp8_full":
        with pytest.raises(ConfigError, match="fp8_full"):
            _composed(overrides)
    else:
        run_cfg = _composed(overrides)
        assert run_cfg.algo.name == algo and run_cfg.precision.mode == precision


# ---------------------------------------------------------------------------------------------- identity
def test_config_hash_ignores_where_a_run_is_stored_but_not_what_it_computes() -> None:
    a = RunConfig()
    b = with_overrides(a, {"trainer.out_dir": "/elsewhere", "tracking.experiment": "other", "trainer.threads": 2})
    assert config_hash(a) == config_hash(b)
    assert config_hash(a) != config_hash(with_overrides(a, {"algo.lr": 3e-5}))


def test_the_default_run_folder_is_derived_from_the_config_hash() -> None:
    cfg = RunConfig()
    assert run_dir(cfg) == f"outputs/runs/grpo-bf16-standard-s0-{config_hash(cfg)}"
    assert run_dir(with_overrides(cfg, {"trainer.out_dir": "x"})) == "x"


@pytest.mark.parametrize("path", sorted(glob.glob(str(ROOT / "results/*/*.runs.json"))), ids=lambda p: Path(p).name)
def test_published_runs_keep_their_config_hash(path: str) -> None:
    """Every run in results/ recomputes to the hash MLflow recorded for it, from its logged params
    (legacy field names mapped): sweeps keep recognising finished runs after a schema change."""
    runs = json.loads(Path(path).read_text())["runs"]
    assert runs
    for run in runs:
        assert config_hash(from_params(run["config"])) == run["tags"]["fp8rl.config_hash"], run["run_name"]


@pytest.mark.parametrize("algo", ["grpo", "dapo"])
def test_presets_run_verls_loss_where_the_paper_is_silent(algo: str) -> None:
    """verl (which the paper ran) aggregates token-mean and dual-clips negative advantages at c = 3 by default
    (actor.yaml loss_agg_mode / clip_ratio_c, core_algos.compute_policy_loss_vanilla): docs/reproduce.md."""
    cfg = _composed([f"algo={algo}"]).algo
    assert (cfg.loss_agg, cfg.policy_loss, cfg.dual_clip_c) == ("token-mean", "dual_clip", 3.0)


def test_identity_is_declared_with_each_field() -> None:
    """Which fields enter the hash comes from the fields' own declarations (`option(hashed=..., neutral=...)`):
    there is no list to keep in step. A field added at its neutral value leaves the hash as it was."""
    from fp8rl.identity import identity_rules

    unhashed, neutral = identity_rules()
    assert {"trainer.out_dir", "trainer.threads", "tracking.experiment", "warmstart.cache_dir"} <= set(unhashed)
    assert neutral["task.overlong_prompts"] == ("refuse",) and neutral["parallel.tensor_parallel"] == (None,)
    cfg = RunConfig()
    moved = with_overrides(cfg, {"task.overlong_prompts": "filter"})
    assert config_hash(moved) != config_hash(cfg)  # away from its neutral value it is part of the identity


def test_params_of_a_removed_field_still_read_back() -> None:
    """`trainer.keep_freed_memory` (glibc allocator tuning, speed only, never hashed) was removed; runs that
    logged it keep their identity."""
    params = {k: str(v) for k, v in flatten(to_dict(RunConfig())).items()}
    params["trainer.keep_freed_memory"] = "False"
    assert config_hash(from_params(params)) == config_hash(RunConfig())


def test_the_torchao_backend_runs_its_own_recipes_only() -> None:
    from fp8rl.choices import validated

    fp8 = {"precision.mode": "fp8_full"}
    validated(with_overrides(RunConfig(), {**fp8, "precision.recipe": "rowwise", "precision.backend": "torchao"}))
    with pytest.raises(ConfigError, match="precision.backend=torchao has no FP8 recipe 'blockwise'"):
        validated(with_overrides(RunConfig(), {**fp8, "precision.recipe": "blockwise", "precision.backend": "torchao"}))
    with pytest.raises(ConfigError, match="torchao scales each rank's shard itself"):
        with_overrides(RunConfig(), {**fp8, "precision.backend": "torchao", "precision.amax_reduction": "tp_invariant"})


def test_an_fp8_kv_cache_is_calibrated_by_default_on_either_engine_and_unit_scales_are_an_option() -> None:
    kv = {"precision.mode": "fp8_full", "precision.fp8_kv_cache": True}
    assert with_overrides(RunConfig(), kv).precision.kv_cache_scales == "calibrated"
    with_overrides(RunConfig(), {**kv, "rollout.engine": "vllm"})  # vLLM takes the calibrated scales too
    with_overrides(RunConfig(), {**kv, "precision.kv_cache_scales": "unit"})
    with pytest.raises(ConfigError, match="precision.kv_cache_scales='per_head' is not valid"):
        with_overrides(RunConfig(), {**kv, "precision.kv_cache_scales": "per_head"})


def test_kv_cache_scales_enter_the_identity_only_with_an_fp8_kv_cache() -> None:
    """The default moved from unit to calibrated: runs without an FP8 KV cache keep their hash (the scales compute
    nothing there), unit-scale runs logged before the field existed read back as unit, and the two policies of an
    FP8 KV cache hash apart."""
    fp8 = with_overrides(RunConfig(), {"precision.mode": "fp8_full"})
    assert config_hash(with_overrides(fp8, {"precision.kv_cache_scales": "unit"})) == config_hash(fp8)
    kv = with_overrides(fp8, {"precision.fp8_kv_cache": True})
    unit = with_overrides(kv, {"precision.kv_cache_scales": "unit"})
    assert config_hash(kv) != config_hash(unit)
    legacy = {k: str(v) for k, v in flatten(to_dict(unit)).items() if k != "precision.kv_cache_scales"}
    assert from_params(legacy).precision.kv_cache_scales == "unit"
    assert config_hash(from_params(legacy)) == config_hash(unit)
