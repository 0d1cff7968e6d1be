"""Parallel layouts: the presets fit, bad layouts fail before launch with what to change."""

import dataclasses

import pytest

from fp8rl.config import ConfigError, RunConfig, with_overrides
from fp8rl.identity import config_hash
from fp8rl.launch.launchers import check_fits, resolve_launcher
from fp8rl.models.config import get_model_config, parameter_count
from fp8rl.models.parallel import (
    PARALLEL_PRESETS,
    ParallelLayout,
    ParallelLayoutError,
    check_layout,
    estimate_memory_gb,
    memory_breakdown_gb,
    preset_layout,
    valid_tensor_parallel,
)
from fp8rl.preflight import PreflightError, run_layout

GPU_PRESETS = ("qwen3_8b", "qwen3_14b", "qwen2_5_32b")


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_presets_fit_an_80gb_gpu_and_use_whole_8_gpu_nodes(preset: str) -> None:
    layout, model = preset_layout(preset), get_model_config(preset)
    check_layout(layout, model)
    assert layout.gpus_per_node == 8 and layout.world_size % 8 == 0
    assert layout.tensor_parallel * layout.pipeline_parallel * layout.data_parallel == layout.world_size
    assert estimate_memory_gb(layout, model) < layout.gpu_memory_gb


def test_layout_description_names_every_size() -> None:
    text = preset_layout("qwen2_5_32b").describe()
    assert text == (
        "2 node(s) x 8 GPUs: trainer TP 8 x PP 1 x DP 2, seq 4096, micro-batch 1, distributed optimizer, full "
        "recompute; vLLM colocated on all 16 GPUs (TP 4)"
    )


def test_a_cpu_run_is_described_as_processes_not_gpus() -> None:
    text = preset_layout("tiny").describe("cpu", "builtin")
    assert (
        text == "1 CPU process(es): trainer TP 1 x PP 1 x DP 1, seq 64; rollout: the builtin engine in those processes"
    )


def test_memory_estimate_counts_sharding_recompute_and_the_colocated_engine() -> None:
    model, base = get_model_config("qwen3_8b"), preset_layout("qwen3_8b")
    mem = lambda **kw: estimate_memory_gb(dataclasses.replace(base, **kw), model)  # noqa: E731
    assert mem(tensor_parallel=4) < mem()
    assert mem(nodes=2) < mem()  # more DP ranks shard the distributed optimizer's state
    assert mem(distributed_optimizer=False) > mem()
    assert mem(activation_recompute=False) > mem() + 20
    assert mem(rollout_sleep=False) > mem()  # vLLM's share and the training transients at once


def test_memory_breakdown_parts() -> None:
    """FP32 main grads (4 B/param, TP x PP only: Megatron's grad buffer is whole on every DP rank), BF16
    weights, DP-sharded optimizer, full-vocabulary logits in FP32, vLLM's share; sleep mode overlaps the
    share with the training transients instead of adding them."""
    model, base = get_model_config("qwen3_8b"), preset_layout("qwen3_8b")  # TP 2, DP 4, seq 16384
    params = parameter_count(model)
    parts = memory_breakdown_gb(base, model)
    assert parts["weights"] == pytest.approx(2 * params / 2 / 1e9)
    assert parts["main_grads"] == pytest.approx(4 * params / 2 / 1e9)
    assert parts["optimizer"] == pytest.approx(12 * params / 8 / 1e9)
    assert parts["logits"] == pytest.approx(16384 * model.vocab_size * (1 + 2 + 8) / 1e9)
    assert parts["rollout"] == pytest.approx(0.35 * 80)
    assert parts["rollout_weights"] == pytest.approx(2 * params / 1e9)  # vLLM TP 1
    assert parts["rollout_kv_one_sequence"] == pytest.approx(2 * 36 * 8 * 128 * 2 * 16384 / 1e9)
    resident = parts["weights"] + parts["main_grads"] + parts["optimizer"]
    transients = parts["activations"] + parts["logits"]
    assert parts["total"] == pytest.approx(resident + max(transients, parts["rollout"]))
    awake = memory_breakdown_gb(dataclasses.replace(base, rollout_sleep=False), model)
    assert awake["total"] == pytest.approx(resident + transients + parts["rollout"])
    more_dp = memory_breakdown_gb(dataclasses.replace(base, nodes=2), model)
    assert more_dp["main_grads"] == parts["main_grads"] and more_dp["optimizer"] == pytest.approx(
        parts["optimizer"] / 2
    )
    separate = memory_breakdown_gb(dataclasses.replace(base, rollout_placement="separate", rollout_gpus=2), model)
    assert separate["rollout"] == 0 and separate["total"] == pytest.approx(
        separate["weights"] + separate["main_grads"] + separate["optimizer"] + transients
    )
    tp1 = memory_breakdown_gb(dataclasses.replace(base, tensor_parallel=1), model)
    assert tp1["logits"] == pytest.approx(16384 * model.vocab_size * (2 + 8) / 1e9)  # no gather at TP 1


@pytest.mark.parametrize(
    ("preset", "change", "message"),
    [
        (
            "qwen3_8b",
            {"tensor_parallel": 3},
            r"does not divide qwen3_8b's 32 query heads / 8 KV groups; choose a TP in \[1, 2, 4, 8\]",
        ),
        ("qwen3_14b", {"tensor_parallel": 5}, r"choose a TP in \[1, 2, 4, 8\]"),
        ("qwen3_8b", {"pipeline_parallel": 7}, r"does not divide qwen3_8b's 36 layers"),
        ("qwen3_8b", {"tensor_parallel": 16, "nodes": 2}, r"spans more than one node"),
        ("qwen3_8b", {"activation_recompute": False}, r"needs ~\d+ GB per GPU .* the GPU has 80 GB"),
        ("qwen2_5_32b", {"nodes": 1}, r"needs ~\d+ GB per GPU"),
        (
            "qwen2_5_32b",
            {"rollout_tensor_parallel": 1},
            r"vLLM needs ~67 GB per GPU .* its share is 28 GB: raise parallel.rollout_tensor_parallel",
        ),
        (
            "qwen3_8b",
            {"rollout_memory_fraction": 0.2},
            r"vLLM needs ~19 GB per GPU .* its share is 16 GB",
        ),
        ("qwen3_8b", {"max_seq_len": 65536}, r"exceeds qwen3_8b's 32768 positions"),
        ("qwen3_8b", {"rollout_placement": "separate"}, r"needs 0 < parallel.rollout_gpus < 8"),
        ("qwen3_8b", {"rollout_placement": "remote"}, r"choose one of \('colocated', 'separate'\)"),
        ("qwen3_8b", {"rollout_gpus": 2}, r"rollout_gpus is for rollout_placement=separate"),
        (
            "qwen3_8b",
            {"rollout_placement": "separate", "rollout_gpus": 3, "rollout_tensor_parallel": 2},
            r"not a multiple of the vLLM TP",
        ),
        (
            "qwen3_8b",
            {"rollout_placement": "separate", "rollout_gpus": 3},
            r"5 trainer GPUs are not a multiple of TP x PP = 2",
        ),
    ],
)
def test_bad_layouts_say_what_to_change(preset: str, change: dict, message: str) -> None:
    with pytest.raises(ParallelLayoutError, match=message):
        check_layout(preset_layout(preset, **change), get_model_config(preset))


def test_h200_memory_admits_the_8b_run_without_recompute() -> None:
    check_layout(
        preset_layout("qwen3_8b", activation_recompute=False, gpu_memory_gb=141.0), get_model_config("qwen3_8b")
    )


def test_unknown_preset_and_setting() -> None:
    assert preset_layout("hf-llama") == ParallelLayout()  # a checkpoint without a preset: the defaults
    with pytest.raises(ParallelLayoutError, match="unknown parallel settings"):
        preset_layout("qwen3_8b", expert_parallel=2)
    assert set(PARALLEL_PRESETS) >= set(GPU_PRESETS)
    assert valid_tensor_parallel(get_model_config("qwen3_14b"), 8) == [1, 2, 4, 8]


def paper_cfg(preset: str = "qwen3_8b", **changes) -> RunConfig:
    return with_overrides(
        RunConfig(), {"model.preset": preset, "model.device": "cuda", "precision.backend": "te", **changes}
    )


def test_preflight_checks_the_layout_for_the_world_size_before_launch() -> None:
    assert run_layout(paper_cfg(), world_size=8).data_parallel == 4
    with pytest.raises(PreflightError, match="parallel.tensor_parallel=3 does not divide"):
        run_layout(paper_cfg(**{"parallel.tensor_parallel": 3}), world_size=9)
    with pytest.raises(PreflightError, match="cannot hold TP x PP"):
        run_layout(paper_cfg(), world_size=7)


def test_an_unset_parallel_section_leaves_the_config_hash_unchanged() -> None:
    cfg = RunConfig()
    before = config_hash(cfg)
    assert config_hash(with_overrides(cfg, {"parallel.tensor_parallel": 2})) != before
    assert config_hash(with_overrides(cfg, {"parallel.tensor_parallel": None})) == before
    # the defaults before clipping.ema was unified and before the presets took verl's loss
    legacy = with_overrides(
        cfg, {"clipping.ema": 0.0, "algo.loss_agg": "seq-mean-token-mean", "algo.policy_loss": "ppo_clip"}
    )
    assert config_hash(legacy) == "397e31ecdddab46d"  # the default config's hash before the section existed


def test_slurm_profile_must_give_the_layout_its_nodes_and_gpus() -> None:
    launcher = resolve_launcher("slurm", "example_h100", {}, None)
    check_fits(paper_cfg("qwen3_8b"), launcher)
    with pytest.raises(ConfigError, match=r"needs nodes=2, gpus_per_node=8.*--set nodes=2"):
        check_fits(paper_cfg("qwen2_5_32b"), launcher)
    check_fits(paper_cfg("qwen2_5_32b"), resolve_launcher("slurm", "example_h100", {"nodes": 2}, None))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rollout_tensor_parallel": 3}, r"rollout_tensor_parallel=3 does not divide the 8 GPUs"),
        ({"rollout_memory_fraction": 1.2}, r"rollout_memory_fraction=1.2 must be in \(0, 1\)"),
    ],
)
def test_a_colocated_rollout_that_cannot_be_placed_is_refused(overrides: dict, message: str) -> None:
    with pytest.raises(ParallelLayoutError, match=message):
        check_layout(preset_layout("qwen3_8b", **overrides), get_model_config("qwen3_8b"), memory=False)


def test_a_separate_rollout_placement_is_refused_until_the_job_runs_one() -> None:
    """The job runs its vLLM engine on the trainer's own ranks: a separate placement would silently colocate."""
    cfg = with_overrides(RunConfig(), {"parallel.rollout_placement": "separate", "parallel.rollout_gpus": 1})
    with pytest.raises(PreflightError, match="not run by the job yet"):
        run_layout(cfg, 2)


def test_an_emulated_arm_at_paper_scale_counts_its_unfused_attention_and_is_refused_where_it_cannot_fit() -> None:
    """The emulated backend (the rowwise arms on a GPU) runs megatron's local attention: qwen3_8b at 16K holds
    ~17 GB of one layer's scores, which the estimate used to leave out (it passed at 68 of 80 GB)."""
    model, layout = get_model_config("qwen3_8b"), preset_layout("qwen3_8b")
    check_layout(layout, model)  # Transformer Engine's fused attention fits an H100
    parts = memory_breakdown_gb(layout, model, unfused_attention=True)
    assert parts["attention_scores"] == pytest.approx(4 * 16 * 16384**2 / 1e9)
    with pytest.raises(ParallelLayoutError, match="attention scores and probabilities.*precision.backend=te"):
        check_layout(layout, model, unfused_attention=True)
    check_layout(dataclasses.replace(layout, gpu_memory_gb=141.0), model, unfused_attention=True)  # an H200 holds it


def test_preflight_refuses_a_paper_scale_rowwise_arm_that_cannot_fit_and_passes_its_te_sibling() -> None:
    base = {
        "model.preset": "qwen3_8b",
        "model.device": "cuda",
        "precision.mode": "fp8_full",
        "algo.prompts_per_step": 32,
    }
    with pytest.raises(PreflightError, match="torchao FP8 backends materialise"):
        run_layout(with_overrides(RunConfig(), {**base, "precision.recipe": "rowwise"}), 8)
    run_layout(with_overrides(RunConfig(), {**base, "precision.recipe": "tensorwise", "precision.backend": "te"}), 8)
