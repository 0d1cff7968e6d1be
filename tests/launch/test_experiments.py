"""Every experiment in sweeps/experiment/ composes, validates at both scales, and runs for a couple of steps.

Composing and validating covers every point of every experiment; running covers one representative
point per experiment (its last one, the calibrated arm where there is one) for 2 CPU steps, so that no
experiment file rots.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fp8rl.config import ConfigError, to_dict
from fp8rl.launch.experiment import expand_experiment, expand_points, list_experiments
from fp8rl.launch.launchers import resolve_launcher
from fp8rl.launch.sweep import SweepConfigError, prepare

ARM_SEED = ["+experiment/arm", "trainer.seed"]
EXPECTED = {  # experiment -> (points, axes); the tables' files carry their seeds
    "grpo_granularity": (80, ARM_SEED),
    "dapo_table": (24, ARM_SEED),
    "ablation_lower_only": (6, ARM_SEED),
    "stress_outliers": (12, ARM_SEED),
    "ablation_recal_interval": (9, ["clipping.interval", "trainer.seed"]),
    "ablation_init_bounds": (6, ARM_SEED),
    "ablation_first_calibration": (9, ARM_SEED),
    "fp8_rollout_baseline": (4, ["precision", "clipping"]),
    "collapse": (3, ["+experiment/arm"]),
    "junk_gate": (2, ARM_SEED),
    "junk_dose": (15, ARM_SEED),
    "junk_fp8_pilot": (1, [*ARM_SEED, "trainer.shadow_every"]),
    "junk_arms": (9, ARM_SEED),
}
# CPU-scale studies (their own task and model): no paper-scale form
CPU_STUDIES = {"collapse", "junk_gate", "junk_dose", "junk_fp8_pilot", "junk_arms"}
PAPER_MODELS = {"dapo_table": "qwen3_14b"}
URI = "sqlite:///unused.db"


def test_every_experiment_is_known() -> None:
    assert list_experiments() == sorted(EXPECTED)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("experiment", sorted(EXPECTED))
def test_all_points_compose_and_validate_at_tiny_scale(experiment: str, tmp_path: Path, tiny: list[str]) -> None:
    definition = expand_experiment(experiment, "tiny", tiny)
    n_points, axes = EXPECTED[experiment]
    assert (len(definition.points), definition.axes, definition.scale) == (n_points, axes, "tiny")
    planned = prepare(definition, f"{experiment}-tiny", resolve_launcher("local"), URI, tmp_path)
    assert len({p.config_hash for p in planned}) == n_points
    for run in planned:
        assert (run.cfg.model.preset, run.cfg.model.device, run.cfg.trainer.steps) == ("tiny", "cpu", 2)
        assert run.cfg.tracking.experiment == f"{experiment}-tiny"
        assert run.cfg.trainer.out_dir == str((tmp_path / f"{experiment}-tiny" / run.config_hash).resolve())
        assert all(
            run.cfg.tracking.tags[f"sweep.{k.split('/')[-1].lstrip('+')}"] == v for k, v in run.point.axes.items()
        )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("experiment", sorted(set(EXPECTED) - CPU_STUDIES))
def test_all_points_validate_at_paper_scale_on_a_gpu_profile(experiment: str, tmp_path: Path) -> None:
    definition = expand_experiment(experiment, "paper")
    planned = prepare(definition, experiment, resolve_launcher("slurm", "example_h100"), URI, tmp_path)
    assert len(planned) == EXPECTED[experiment][0]
    for run in planned:
        cfg = run.cfg
        assert cfg.model.preset == PAPER_MODELS.get(experiment, "qwen3_8b")
        # Transformer Engine has no rowwise recipe: rowwise arms run the emulator (the arm files say so).
        expected_backend = "emulated" if cfg.precision.mode != "bf16" and cfg.precision.recipe == "rowwise" else "te"
        assert (cfg.model.device, cfg.precision.backend) == ("cuda", expected_backend)
        assert cfg.algo.prompts_per_step * cfg.algo.group_size == 256  # the paper's batch
        assert cfg.trainer.threads == 12  # the profile's cpus_per_task
    # The same points on a launcher without GPUs fail before anything is submitted, saying what to change.
    with pytest.raises(SweepConfigError, match=r"need a GPU, but launcher local has none: use scale=tiny"):
        prepare(definition, experiment, resolve_launcher("local"), URI, tmp_path)


@pytest.mark.timeout(120)
def test_paper_scale_differs_from_tiny_only_in_size() -> None:
    tiny = expand_experiment("dapo_table", "tiny").points[-1].cfg
    paper = expand_experiment("dapo_table", "paper").points[-1].cfg
    assert tiny.algo.name == paper.algo.name == "dapo"
    assert tiny.clipping.policy == paper.clipping.policy == "calibrated"
    assert tiny.precision.recipe == paper.precision.recipe == "blockwise"
    assert (tiny.model.preset, paper.model.preset) == ("tiny", "qwen3_14b")


@pytest.mark.timeout(120)
def test_command_line_sweep_adds_an_axis_or_replaces_the_files_and_a_plain_override_pins_one(tmp_path: Path) -> None:
    added = expand_experiment("ablation_recal_interval", "tiny", ["trainer.seed=0,1", "algo.lr=1e-5,2e-5"])
    assert (len(added.points), added.axes) == (12, ["clipping.interval", "trainer.seed", "algo.lr"])
    pinned = expand_experiment("ablation_recal_interval", "tiny", ["clipping.interval=7", "trainer.seed=4"])
    assert (len(pinned.points), pinned.axes) == (1, [])
    assert (pinned.points[0].cfg.clipping.interval, pinned.points[0].cfg.trainer.seed) == (7, 4)
    replaced = expand_experiment("ablation_recal_interval", "tiny", ["clipping.interval=2,5", "trainer.seed=0"])
    assert (len(replaced.points), replaced.axes) == (2, ["clipping.interval"])
    assert [p.cfg.clipping.interval for p in replaced.points] == [2, 5]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["recipe=blockwise"], r"precision.recipe=blockwise is an FP8 scaling recipe but precision.mode=bf16"),
        (["algo.num_minibatches=5"], r"not divisible by algo.num_minibatches=5"),
        (["algo.prompts_per_step=3", "algo.num_minibatches=2"], r"splits groups of 8"),
        (["algo.group_size=1"], r"algo.group_size=1"),
        (["model=qwen3_8b", "scale=paper", "precision.backend=emulated"], r"model.device=cuda need a GPU"),
    ],
)
def test_impossible_combinations_fail_for_the_whole_sweep(overrides: list[str], message: str, tmp_path: Path) -> None:
    definition = expand_experiment("fp8_rollout_baseline", None, overrides)
    with pytest.raises(SweepConfigError, match=message) as err:
        prepare(definition, "x", resolve_launcher("local"), URI, tmp_path)
    assert "nothing was submitted" in str(err.value)


@pytest.mark.timeout(120)
def test_points_that_compute_the_same_run_are_refused(tmp_path: Path) -> None:
    definition = expand_points([["precision=bf16"], ["precision=bf16", "trainer.threads=1"]], ["scale=tiny"])
    with pytest.raises(SweepConfigError, match="compute the same run"):
        prepare(definition, "x", resolve_launcher("local"), URI, tmp_path)


@pytest.mark.timeout(120)
def test_a_point_that_does_not_compose_is_reported_with_the_others(tmp_path: Path) -> None:
    definition = expand_points([["precision=bf16"], ["precision=fp4"], ["algo.nonsense=1"]], ["scale=tiny"])
    with pytest.raises(SweepConfigError) as err:
        prepare(definition, "x", resolve_launcher("local"), URI, tmp_path)
    text = str(err.value)
    assert "2 of 3 point(s) cannot run" in text and "fp4" in text and "nonsense" in text


def test_unknown_experiment_and_scale() -> None:
    with pytest.raises(ConfigError, match="unknown experiment 'grpo'.*grpo_granularity"):
        expand_experiment("grpo")
    with pytest.raises(ConfigError, match="scale='huge'"):
        expand_experiment("dapo_table", "huge")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("experiment", sorted(EXPECTED))
def test_a_representative_point_of_each_experiment_runs_two_steps(
    experiment: str, tmp_path: Path, tiny: list[str]
) -> None:
    from fp8rl.launch.train_job import TrainJob

    definition = expand_experiment(experiment, "tiny", [*tiny, "tracking.enabled=false"])
    run = prepare(definition, experiment, resolve_launcher("inline"), URI, tmp_path)[-1]
    result = TrainJob(to_dict(run.cfg))()
    assert result["steps_done"] == 2
    assert math.isfinite(result["final_eval"]["eval/accuracy"])
    assert (Path(run.cfg.trainer.out_dir) / "checkpoints").is_dir()


# The overrides `make reproduce` adds at tiny scale (the Makefile's RECAL_K): the files carry the rest.
MAKE_OVERRIDES = {"ablation_recal_interval": ["clipping.interval=2,5,10"]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "published", sorted(Path(__file__).parents[2].glob("results/tiny/*-tiny.runs.json")), ids=lambda p: p.name
)
def test_each_experiment_file_composes_exactly_its_published_tables_runs(published: Path) -> None:
    """Its arms and seeds included: `make reproduce` is a list of experiments, and each file, as `make` runs it,
    recomputes the config hashes of the runs its table was built from, no more and no fewer."""
    import json

    from fp8rl.identity import config_hash

    experiment = published.name.removesuffix("-tiny.runs.json")
    definition = expand_experiment(experiment, "tiny", MAKE_OVERRIDES.get(experiment, []))
    runs = json.loads(published.read_text())["runs"]
    assert sorted(config_hash(p.cfg) for p in definition.points) == sorted(r["tags"]["fp8rl.config_hash"] for r in runs)
