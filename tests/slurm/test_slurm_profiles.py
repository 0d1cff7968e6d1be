"""Cluster profiles (slurm/profiles/*.yaml): they compose as Hydra ``hydra/launcher`` configs, and the
sbatch script submitit renders from each matches a golden file (tests/slurm/golden/<profile>.sbatch).

No Slurm needed. Regenerate the golden files after an intended change (new profile, profile edit,
submitit upgrade) with::

    FP8RL_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/slurm/test_slurm_profiles.py

and review the diff. Paths that vary per run are masked: the submitit folder as ``<SUBMITIT_FOLDER>``
and the Python interpreter as ``<PYTHON>``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import submitit.slurm.slurm as submitit_slurm

from ._slurm_testlib import PROFILES_DIR, executor_from_params, load_profile, profile_names

GOLDEN_DIR = Path(__file__).parent / "golden"
UPDATE_GOLDEN = os.environ.get("FP8RL_UPDATE_GOLDEN") == "1"
JOB_NAME = "fp8rl-golden"


def render_sbatch(profile: str, folder: Path) -> str:
    """The sbatch script submitit would submit for a hydra/launcher=<profile> job, paths masked."""
    params = load_profile(profile, name=JOB_NAME, submitit_folder=str(folder / "%j"))
    executor = executor_from_params(params)._executor
    text = executor._make_submission_file_text(executor._submitit_command_str, "uid")
    return text.replace(str(folder), "<SUBMITIT_FOLDER>").replace(shlex.quote(sys.executable), "<PYTHON>")


@pytest.fixture(autouse=True)
def _pretend_srun_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    # SlurmExecutor refuses to exist without `srun` on PATH; rendering does not need it.
    monkeypatch.setattr(submitit_slurm.SlurmExecutor, "affinity", classmethod(lambda cls: 2))


@pytest.mark.parametrize("profile", profile_names())
def test_sbatch_matches_golden(profile: str, tmp_path: Path) -> None:
    rendered = render_sbatch(profile, tmp_path / "submitit")
    golden = GOLDEN_DIR / f"{profile}.sbatch"
    if UPDATE_GOLDEN:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(rendered)
        pytest.skip(f"FP8RL_UPDATE_GOLDEN=1: wrote {golden}")
    assert golden.exists(), f"no golden file {golden}: run with FP8RL_UPDATE_GOLDEN=1 to create it"
    assert rendered == golden.read_text(), (
        f"sbatch script for profile '{profile}' differs from {golden}; if intended, regenerate with "
        "FP8RL_UPDATE_GOLDEN=1 and review the diff"
    )


def test_every_golden_file_has_a_profile() -> None:
    assert sorted(p.stem for p in GOLDEN_DIR.glob("*.sbatch")) == profile_names()


def test_local_profile_sbatch_essentials(tmp_path: Path) -> None:
    # What the local cluster relies on, independent of the golden file's exact text.
    text = render_sbatch("local", tmp_path)
    assert "#SBATCH --partition=local" in text
    assert "#SBATCH --signal=USR2@30" in text
    assert "<PYTHON> -u -m submitit.core._submit <SUBMITIT_FOLDER>" in text


@pytest.mark.parametrize("profile", profile_names())
def test_profile_composes_with_hydra(profile: str, tmp_path: Path) -> None:
    """Dropped into a config dir as hydra/launcher/<profile>.yaml, the profile selects SlurmLauncher
    with the profile's values (i.e. the file works as-is in Hydra's hydra/launcher group)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    launcher_dir = tmp_path / "conf" / "hydra" / "launcher"
    launcher_dir.mkdir(parents=True)
    shutil.copy(PROFILES_DIR / f"{profile}.yaml", launcher_dir / f"{profile}.yaml")
    (tmp_path / "conf" / "config.yaml").write_text("x: 1\n")
    overrides = [f"hydra/launcher={profile}", f"hydra.launcher.name={JOB_NAME}", "hydra.launcher.submitit_folder=/f/%j"]
    with initialize_config_dir(config_dir=str(tmp_path / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher["_target_"] == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert launcher == load_profile(profile, name=JOB_NAME, submitit_folder="/f/%j")
