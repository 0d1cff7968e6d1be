"""Launchers: cluster profiles, the submitit executors built from them, and the Hydra launcher configs.

Both routes submit the same sbatch script: the runner (`fp8rl sweep --launcher slurm --profile P`) and
Hydra's (`python -m fp8rl.train -m hydra/launcher=slurm_P`, through hydra-submitit-launcher).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest
import submitit.slurm.slurm as submitit_slurm

from fp8rl.config import ConfigError, RunConfig, with_overrides
from fp8rl.launch.experiment import SWEEPS_DIR
from fp8rl.launch.launchers import PROFILES_DIR, check_fits, load_profile, make_executor, resolve_launcher

pytestmark = pytest.mark.timeout(120)
PROFILES = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
GOLDEN_DIR = Path(__file__).resolve().parents[1] / "slurm" / "golden"


@pytest.fixture(autouse=True)
def _pretend_srun_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    # SlurmExecutor refuses to exist without `srun` on PATH; rendering does not need it.
    monkeypatch.setattr(submitit_slurm.SlurmExecutor, "affinity", classmethod(lambda cls: 2))


def test_launcher_kinds() -> None:
    local = resolve_launcher("local", max_parallel=3)
    assert (local.kind, local.max_parallel, local.params["timeout_min"]) == ("local", 3, 24 * 60)
    slurm = resolve_launcher("slurm", overrides={"timeout_min": 30})
    assert (slurm.profile, slurm.params["partition"], slurm.params["timeout_min"]) == ("local", "local", 30)
    assert not slurm.has_gpu and resolve_launcher("slurm", "example_h100").has_gpu
    with pytest.raises(ConfigError, match="launcher='pbs'"):
        resolve_launcher("pbs")
    with pytest.raises(ConfigError, match=r"unknown Slurm profile 'h200'; valid: \['example_h100', 'local'\]"):
        resolve_launcher("slurm", "h200")


def test_a_profile_can_be_a_path(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("defaults:\n  - submitit_slurm\n  - _self_\npartition: big\ngpus_per_task: 1\n")
    launcher = resolve_launcher("slurm", str(path))
    assert launcher.params["partition"] == "big" and launcher.has_gpu
    path.write_text("partition: big\n")
    with pytest.raises(ConfigError, match="must extend submitit_slurm"):
        resolve_launcher("slurm", str(path))


def test_gpu_only_settings_on_a_cpu_launcher_say_what_to_change() -> None:
    cfg = with_overrides(RunConfig(), {"model.device": "cuda"})
    with pytest.raises(ConfigError, match=r"model.device=cuda need a GPU, but launcher slurm \(profile local\)"):
        check_fits(cfg, resolve_launcher("slurm", "local"))
    # the tiny model is one process on one GPU: an 8-rank node profile does not fit its layout
    with pytest.raises(ConfigError, match=r"tiny's layout .* needs nodes=1, gpus_per_node=1, tasks_per_node=1"):
        check_fits(cfg, resolve_launcher("slurm", "example_h100"))
    check_fits(cfg, resolve_launcher("slurm", "example_h100", {"gpus_per_node": 1, "tasks_per_node": 1}, None))
    check_fits(RunConfig(), resolve_launcher("slurm", "local"))


@pytest.mark.parametrize("profile", PROFILES)
def test_runner_submits_the_sbatch_script_of_the_golden_file(profile: str, tmp_path: Path) -> None:
    """The runner's executor renders exactly what tests/slurm/golden/<profile>.sbatch holds."""
    folder = tmp_path / "submitit"
    executor = make_executor(resolve_launcher("slurm", profile), folder, job_name="fp8rl-golden")._executor
    text = executor._make_submission_file_text(executor._submitit_command_str, "uid")
    text = text.replace(str(folder), "<SUBMITIT_FOLDER>").replace(shlex.quote(sys.executable), "<PYTHON>")
    assert text == (GOLDEN_DIR / f"{profile}.sbatch").read_text()


@pytest.mark.parametrize("profile", PROFILES)
def test_every_profile_is_a_hydra_launcher_of_the_train_app(profile: str) -> None:
    link = SWEEPS_DIR / "hydra" / "launcher" / f"slurm_{profile}.yaml"
    assert link.is_symlink() and link.resolve() == (PROFILES_DIR / f"{profile}.yaml").resolve(), (
        f"add it: ln -s ../../../slurm/profiles/{profile}.yaml {link}"
    )
    launcher = _compose_launcher([f"hydra/launcher=slurm_{profile}", "hydra.launcher.name=n"])
    assert launcher.pop("_target_").endswith("SlurmLauncher")
    assert launcher == load_profile(profile, name="n", submitit_folder="/f/%j")


def test_the_default_hydra_launcher_is_submitit_local() -> None:
    launcher = _compose_launcher(["hydra.launcher.name=n"])
    assert launcher["_target_"].endswith("submitit_launcher.LocalLauncher")


def _compose_launcher(overrides: list[str]) -> dict:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    import fp8rl.train  # noqa: F401 - registers the RunConfig schema

    GlobalHydra.instance().clear()
    overrides = [*overrides, "hydra.launcher.submitit_folder=/f/%j"]
    with initialize_config_dir(config_dir=str(SWEEPS_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    return OmegaConf.to_container(cfg.hydra.launcher, resolve=True)  # type: ignore[return-value]


def test_a_vllm_fp8_recipe_that_only_runs_on_gpu_is_refused_on_a_cpu_launcher() -> None:
    from fp8rl.launch.launchers import gpu_requirements

    changes = {"rollout.engine": "vllm", "precision.mode": "fp8_rollout", "precision.recipe": "blockwise"}
    cfg = with_overrides(RunConfig(), changes)
    (need,) = gpu_requirements(cfg)
    assert need.startswith("rollout.engine=vllm with precision.recipe=blockwise") and "rowwise" in need
    with pytest.raises(ConfigError, match="need a GPU, but launcher local has none"):
        check_fits(cfg, resolve_launcher("local"))
    cfg = with_overrides(cfg, {"precision.recipe": "rowwise"})  # vLLM's CPU build runs rowwise FP8
    assert gpu_requirements(cfg) == []
